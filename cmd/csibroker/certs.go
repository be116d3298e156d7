package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/csibroker/csibroker/internal/mtls"
)

func init() {
	register("certs", "mint a development CA and broker/proxy certificates", runCerts)
}

type listFlag []string

func (l *listFlag) String() string { return strings.Join(*l, ",") }
func (l *listFlag) Set(s string) error {
	for _, v := range strings.Split(s, ",") {
		if v = strings.TrimSpace(v); v != "" {
			*l = append(*l, v)
		}
	}
	return nil
}

func runCerts(_ context.Context, args []string, stdout, stderr io.Writer) error {
	var o mtls.DevCertsOptions
	var drivers, nodes, clients listFlag
	fs := flag.NewFlagSet("certs", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&o.Dir, "dir", "certs", "directory to write ca.crt, broker.crt/.key, proxy-<driver>[-<node>].crt/.key and client-<name>.crt/.key into (an existing ca.crt/ca.key is reused; one that cannot be loaded is an error, never replaced)")
	fs.StringVar(&o.TrustDomain, "trust-domain", "csibroker.local", "SPIFFE trust domain")
	fs.Var(&drivers, "driver", "driver name to mint a proxy certificate for (repeatable or comma-separated)")
	fs.Var(&nodes, "node", "node names: with --driver, also mint node-proxy certificates (repeatable or comma-separated)")
	fs.Var(&clients, "client", "client name to mint a certificate for the broker's TCP front end (--listen) for (repeatable or comma-separated); proxies refuse it")
	fs.DurationVar(&o.Validity, "validity", 30*24*time.Hour, "lifetime of the leaf certificates")
	fs.BoolVar(&o.OnlyNodes, "only-nodes", false, "mint only the node-proxy certificates of --driver and --node, from the CA already in --dir (no broker, controller-proxy or client certificate: a node gets nothing that could act as the broker)")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if len(nodes) > 0 && len(drivers) == 0 {
		return errors.New("--node needs at least one --driver")
	}
	if o.Validity <= 0 {
		return fmt.Errorf("--validity %v: must be positive", o.Validity)
	}
	o.Drivers, o.Nodes, o.Clients = drivers, nodes, clients
	files, err := mtls.WriteDevCerts(o)
	if err != nil {
		return err
	}
	for _, f := range files {
		fmt.Fprintln(stdout, f)
	}
	return nil
}
