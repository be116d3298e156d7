package main

import (
	"context"
	"io"

	"github.com/csibroker/csibroker/cmd/internal/cli"
)

// The proxy is also built alone as cmd/csibroker-proxy, with the same flags.
func init() {
	register("proxy", cli.ProxySummary, func(ctx context.Context, args []string, _, stderr io.Writer) error {
		return cli.RunProxy(ctx, "proxy", version, args, stderr)
	})
}
