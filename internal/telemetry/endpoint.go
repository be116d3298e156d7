package telemetry

import (
	"fmt"
	"path/filepath"
	"strings"
)

// UnixTarget turns a CSI endpoint ("unix:///path", "unix:/path", "unix://path"
// or a bare path) into the socket path and a gRPC target for it.
func UnixTarget(endpoint string) (path, target string, err error) {
	p := endpoint
	switch {
	case strings.HasPrefix(p, "unix://"):
		p = strings.TrimPrefix(p, "unix://")
	case strings.HasPrefix(p, "unix:"):
		p = strings.TrimPrefix(p, "unix:")
	case strings.Contains(p, "://"):
		return "", "", fmt.Errorf("endpoint %q: only unix sockets are supported", endpoint)
	}
	if p == "" {
		return "", "", fmt.Errorf("endpoint %q: empty socket path", endpoint)
	}
	if !filepath.IsAbs(p) {
		abs, err := filepath.Abs(p)
		if err != nil {
			return "", "", fmt.Errorf("endpoint %q: %w", endpoint, err)
		}
		p = abs
	}
	return p, "unix://" + p, nil
}
