package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"path"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/csibroker/csibroker/internal/mtls"
	"github.com/csibroker/csibroker/internal/telemetry"
)

// TLSFlags are the certificate flags every mTLS component has.
type TLSFlags struct {
	Cert, Key, CA  string
	TrustDomain    string
	ReloadInterval time.Duration
}

// Register adds the flags to fs.
func (f *TLSFlags) Register(fs *flag.FlagSet) {
	fs.StringVar(&f.Cert, "tls-cert", "", "PEM certificate file (re-read when it changes)")
	fs.StringVar(&f.Key, "tls-key", "", "PEM private key file (re-read when it changes)")
	fs.StringVar(&f.CA, "tls-ca", "", "PEM CA bundle that peers' certificates must chain to (re-read when it changes)")
	fs.StringVar(&f.TrustDomain, "trust-domain", "csibroker.local", "SPIFFE trust domain of the broker's and proxies' identities")
	fs.DurationVar(&f.ReloadInterval, "tls-reload-interval", time.Second, "how often certificate files are checked for changes")
}

// Validate checks the flags.
func (f *TLSFlags) Validate() error {
	if f.Cert == "" || f.Key == "" || f.CA == "" {
		return errors.New("--tls-cert, --tls-key and --tls-ca are required")
	}
	if f.TrustDomain == "" {
		return errors.New("--trust-domain must not be empty")
	}
	if f.ReloadInterval <= 0 {
		return fmt.Errorf("--tls-reload-interval %v: must be positive (how often the certificate files are checked)", f.ReloadInterval)
	}
	return nil
}

// Source loads the certificate files into a reloadable source.
func (f *TLSFlags) Source(log *slog.Logger) (*mtls.FileSource, error) {
	return mtls.NewFileSource(f.Cert, f.Key, f.CA, log)
}

// LogFlags set verbosity and format.
type LogFlags struct {
	V      int
	Format string
}

// Register adds the flags to fs.
func (f *LogFlags) Register(fs *flag.FlagSet) {
	fs.IntVar(&f.V, "v", 0, "log verbosity: 0 info, 4 and above debug (sanitized CSI requests and responses; secrets are never logged; in the broker, client-go, which logs response bodies from 8, is capped at 7)")
	fs.StringVar(&f.Format, "log-format", "text", "log format: text or json")
}

// Validate checks the flags.
func (f *LogFlags) Validate() error {
	if f.Format != "text" && f.Format != "json" {
		return fmt.Errorf("--log-format %q: want text or json", f.Format)
	}
	return nil
}

// Logger builds the logger the flags ask for.
func (f *LogFlags) Logger(w io.Writer) *slog.Logger {
	return telemetry.NewLogger(w, f.V, f.Format == "json")
}

// ParseFlags parses args, reports -h as flag.ErrHelp and refuses positional
// arguments.
//
// On -h it prints every flag and returns flag.ErrHelp. A command line that
// does not parse is said in one line, with a pointer to -h rather than the
// whole flag list, and returned wrapping ErrBadCommandLine (printed already).
func ParseFlags(fs *flag.FlagSet, args []string) error {
	out := fs.Output()
	fs.Usage = func() {} // the flag package's own call; said below instead
	err := fs.Parse(args)
	switch {
	case errors.Is(err, flag.ErrHelp):
		fmt.Fprintf(out, "Usage of %s:\n", fs.Name())
		fs.PrintDefaults()
		return err
	case err != nil:
		// The flag package printed err itself.
		fmt.Fprintf(out, "(run with -h for the flags of %s)\n", fs.Name())
		return fmt.Errorf("%w: %v", ErrBadCommandLine, err)
	case fs.NArg() > 0:
		fmt.Fprintf(out, "unexpected arguments: %v (run with -h for the flags of %s)\n", fs.Args(), fs.Name())
		return fmt.Errorf("%w: unexpected arguments: %v", ErrBadCommandLine, fs.Args())
	}
	return nil
}

// ErrBadCommandLine wraps ParseFlags' errors for a command line that does
// not parse; ParseFlags has printed what is wrong already.
var ErrBadCommandLine = errors.New("bad command line")

// ServeHTTP serves h on addr until ctx is done.
func ServeHTTP(ctx context.Context, addr string, h http.Handler, log *slog.Logger) error {
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("--http-endpoint %q: %w", addr, err)
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
	}()
	log.Info("http endpoint serving", "addr", lis.Addr().String())
	if err := srv.Serve(lis); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// ValidateMetricsPath checks a --metrics-path: a path of its own on the
// HTTP endpoint, next to /healthz and /readyz.
//
// The path becomes a ServeMux pattern, so it must be a clean absolute path
// of literal characters: { and } make a wildcard (or a pattern that
// panics), whitespace splits off a method (a panic), ? and # never reach
// the mux (it would never match), % is an escape (one that may never
// match), and a path that path.Clean changes is redirected away or, with a
// trailing slash, serves a whole subtree.
func ValidateMetricsPath(p string) error {
	switch {
	case !strings.HasPrefix(p, "/") || p == "/":
		return fmt.Errorf("--metrics-path %q: want a path such as /metrics", p)
	case !utf8.ValidString(p):
		return fmt.Errorf("--metrics-path %q: not valid UTF-8", p)
	}
	for _, r := range p {
		if strings.ContainsRune("{}?#%", r) || unicode.IsSpace(r) || !unicode.IsPrint(r) {
			return fmt.Errorf("--metrics-path %q: %q is not allowed in it (want a plain path such as /metrics)", p, r)
		}
	}
	switch c := path.Clean(p); {
	case c != p:
		return fmt.Errorf("--metrics-path %q: not a clean path (%s is)", p, c)
	case p == "/healthz" || p == "/readyz":
		return fmt.Errorf("--metrics-path %q: taken by the health endpoint", p)
	}
	return nil
}
