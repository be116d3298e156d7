package telemetry

import (
	"context"
	"io"
	"log/slog"
)

// NewLogger returns a JSON or text slog logger at verbosity v: 0 logs info and
// above, 1-3 add more detail, 4 and above log at debug level (which includes
// sanitized CSI requests and responses). Secrets are stripped before any CSI
// message reaches a logger, whatever the level.
func NewLogger(w io.Writer, v int, json bool) *slog.Logger {
	opts := &slog.HandlerOptions{Level: slog.Level(-v)}
	if json {
		return slog.New(slog.NewJSONHandler(w, opts))
	}
	return slog.New(slog.NewTextHandler(w, opts))
}

// CapVerbosity returns a logger that writes what l writes, except records
// more verbose than v (below slog level -v, which is how logr's V(n) maps
// onto slog). For libraries whose most verbose logging may hold values
// that must not be logged: client-go logs response bodies, Secrets'
// included, from V(8).
func CapVerbosity(l *slog.Logger, v int) *slog.Logger {
	return slog.New(capHandler{h: l.Handler(), min: slog.Level(-v)})
}

type capHandler struct {
	h   slog.Handler
	min slog.Level
}

func (c capHandler) Enabled(ctx context.Context, l slog.Level) bool {
	return l >= c.min && c.h.Enabled(ctx, l)
}

func (c capHandler) Handle(ctx context.Context, r slog.Record) error {
	if r.Level < c.min {
		return nil
	}
	return c.h.Handle(ctx, r)
}

func (c capHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return capHandler{h: c.h.WithAttrs(as), min: c.min}
}

func (c capHandler) WithGroup(name string) slog.Handler {
	return capHandler{h: c.h.WithGroup(name), min: c.min}
}
