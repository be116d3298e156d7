package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"strings"
	"testing"

	"github.com/csibroker/csibroker/cmd/internal/cli"
)

// TestSubcommandsBadCommandLine: every subcommand with flags says an
// unknown flag or a stray argument once, in one line pointing to -h, and
// exits 2 (main prints nothing more); -h prints the flags and exits 0.
func TestSubcommandsBadCommandLine(t *testing.T) {
	for _, name := range []string{"broker", "proxy", "sample-driver", "certs", "demo", "status"} {
		t.Run(name, func(t *testing.T) {
			for _, tc := range []struct {
				args []string
				say  string
			}{
				{[]string{"--no-such-flag"}, "flag provided but not defined: -no-such-flag\n"},
				{[]string{"stray"}, "unexpected arguments: [stray]"},
			} {
				var stdout, stderr bytes.Buffer
				err := run(context.Background(), append([]string{name}, tc.args...), &stdout, &stderr)
				if !errors.Is(err, cli.ErrBadCommandLine) || exitCode(err) != 2 {
					t.Errorf("%s %s: %v, exit %d; want a bad command line, exit 2", name, tc.args, err, exitCode(err))
				}
				if n := strings.Count(stderr.String(), tc.say); n != 1 {
					t.Errorf("%s %s: %q said %d times, want once:\n%s", name, tc.args, tc.say, n, stderr.String())
				}
				if strings.Contains(stderr.String(), "Usage of") {
					t.Errorf("%s %s: the whole usage printed, want a pointer to -h:\n%s", name, tc.args, stderr.String())
				}
			}
			var stdout, stderr bytes.Buffer
			err := run(context.Background(), []string{name, "-h"}, &stdout, &stderr)
			if !errors.Is(err, flag.ErrHelp) || exitCode(err) != 0 || !strings.Contains(stderr.String(), "Usage of "+name+":") {
				t.Errorf("%s -h: %v, exit %d, printed:\n%s\nwant the usage and exit 0", name, err, exitCode(err), stderr.String())
			}
		})
	}
}
