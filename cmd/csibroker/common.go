package main

import "github.com/csibroker/csibroker/cmd/internal/cli"

// The flags and helpers every subcommand shares live in cmd/internal/cli, so
// that cmd/csibroker-proxy can use them without linking the broker.
type (
	tlsFlags = cli.TLSFlags
	logFlags = cli.LogFlags
)

var (
	parseFlags          = cli.ParseFlags
	serveHTTP           = cli.ServeHTTP
	validateMetricsPath = cli.ValidateMetricsPath
)
