// Command csibroker-proxy is the csibroker proxy alone: the same flags as
// `csibroker proxy`, built without the broker, the Kubernetes client or the
// sample driver, so the process that sits next to every driver socket stays
// small (see BENCHMARKS.md, five drivers). `csibroker-proxy --version` prints
// the version.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"runtime"
	"syscall"

	"github.com/csibroker/csibroker/cmd/internal/cli"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

func main() {
	if len(os.Args) == 2 && (os.Args[1] == "--version" || os.Args[1] == "version") {
		fmt.Printf("csibroker-proxy %s (%s, %s/%s)\n", version, runtime.Version(), runtime.GOOS, runtime.GOARCH)
		return
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	// A second signal ends the process at once.
	context.AfterFunc(ctx, stop)
	err := cli.RunProxy(ctx, "csibroker-proxy", version, os.Args[1:], os.Stderr)
	stop()
	if err != nil {
		switch {
		case errors.Is(err, flag.ErrHelp):
			os.Exit(0) // help asked for, as Go's flag package exits
		case errors.Is(err, cli.ErrBadCommandLine):
			os.Exit(2) // said already
		}
		fmt.Fprintln(os.Stderr, "csibroker-proxy:", err)
		os.Exit(1)
	}
}
