package telemetry

import (
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
