// Command csibroker is the one binary of csibroker: the broker, the proxy, the
// sample CSI driver, the dev certificate minter and the local demo are its
// subcommands. Flags are parsed here, into one Config per component.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"sort"
	"syscall"

	"github.com/csibroker/csibroker/cmd/internal/cli"
)

// command is one subcommand: run parses its own flags from args.
type command struct {
	name    string
	summary string
	run     func(ctx context.Context, args []string, stdout, stderr io.Writer) error
}

var commands = map[string]command{}

// register adds a subcommand; each subcommand's file calls it from init.
func register(name, summary string, run func(ctx context.Context, args []string, stdout, stderr io.Writer) error) {
	if _, dup := commands[name]; dup {
		panic("csibroker: subcommand registered twice: " + name)
	}
	commands[name] = command{name: name, summary: summary, run: run}
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	// The first signal asks for a graceful stop; from then on the default
	// action is back, so a second one ends the process at once.
	context.AfterFunc(ctx, stop)
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	if err != nil {
		// Help, a bare usage and a bad command line were printed already.
		if !errors.Is(err, flag.ErrHelp) && err != errUsage && !errors.Is(err, cli.ErrBadCommandLine) && !errors.As(err, new(printed)) {
			fmt.Fprintln(os.Stderr, "csibroker:", err)
		}
		os.Exit(exitCode(err))
	}
}

// exitCode: 0 for help asked for (as Go's flag package does), 2 for a
// command line that is not one, 1 for anything else.
func exitCode(err error) int {
	switch {
	case errors.Is(err, flag.ErrHelp):
		return 0
	case errors.Is(err, errUsage), errors.Is(err, cli.ErrBadCommandLine):
		return 2
	}
	return 1
}

var errUsage = errors.New("usage")

// printed is an error its subcommand has told the user about already.
type printed struct{ error }

func (p printed) Unwrap() error { return p.error }

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		usage(stderr)
		if len(args) == 0 {
			return errUsage
		}
		return nil
	}
	if args[0] == "--version" || args[0] == "-version" {
		args = append([]string{"version"}, args[1:]...)
	}
	cmd, ok := commands[args[0]]
	if !ok {
		usage(stderr)
		return fmt.Errorf("unknown subcommand %q: %w", args[0], errUsage)
	}
	return cmd.run(ctx, args[1:], stdout, stderr)
}

func usage(w io.Writer) {
	fmt.Fprintln(w, "usage: csibroker <subcommand> [flags]")
	fmt.Fprintln(w, "\nsubcommands:")
	names := make([]string, 0, len(commands))
	for n := range commands {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		fmt.Fprintf(w, "  %-14s %s\n", n, commands[n].summary)
	}
	fmt.Fprintln(w, "\nRun 'csibroker <subcommand> -h' for its flags.")
}
