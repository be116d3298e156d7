package main

import (
	"context"
	"fmt"
	"io"
	"runtime"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

func init() {
	register("version", "print the version", func(_ context.Context, _ []string, stdout, _ io.Writer) error {
		_, err := fmt.Fprintf(stdout, "csibroker %s (%s, %s/%s)\n", version, runtime.Version(), runtime.GOOS, runtime.GOARCH)
		return err
	})
}
