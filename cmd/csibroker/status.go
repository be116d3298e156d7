package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/csibroker/csibroker/internal/telemetry"
	brokerstatusv1 "github.com/csibroker/csibroker/proto/brokerstatus/v1"
)

func init() {
	register("status", "show the broker's drivers, proxies and connection states", runStatus)
}

func runStatus(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("status", flag.ContinueOnError)
	fs.SetOutput(stderr)
	socket := fs.String("socket", "/run/csibroker/csibroker-status.sock", "the broker's status socket (--status-socket of 'csibroker broker')")
	timeout := fs.Duration("timeout", 5*time.Second, "how long to wait for the broker")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	// A relative path is made absolute (unix://relative/path would read
	// "relative" as an authority).
	_, target, err := telemetry.UnixTarget(*socket)
	if err != nil {
		return err
	}
	conn, err := grpc.NewClient(target, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	st, err := brokerstatusv1.NewBrokerStatusClient(conn).GetStatus(ctx, &brokerstatusv1.GetStatusRequest{})
	if err != nil {
		return fmt.Errorf("broker status at %s: %w", *socket, err)
	}
	return printStatus(stdout, st)
}

func printStatus(w io.Writer, st *brokerstatusv1.GetStatusResponse) error {
	leader := "yes"
	if !st.GetLeader() {
		leader = "no (leader: " + st.GetLeaderIdentity() + ")"
	}
	fmt.Fprintf(w, "broker %s, leader: %s\n\n", st.GetVersion(), leader)
	tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "DRIVER\tPROXY\tNODE\tSTATE\tIN FLIGHT\tCALLS\tFAILED")
	for _, d := range st.GetDrivers() {
		for i, p := range d.GetProxies() {
			name, inflight, total, failed := d.GetName(), fmt.Sprint(d.GetInflightCalls()), fmt.Sprint(d.GetTotalCalls()), fmt.Sprint(d.GetFailedCalls())
			if i > 0 {
				name, inflight, total, failed = "", "", "", ""
			}
			node := p.GetNode()
			if node == "" {
				node = "(controller)"
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", name, p.GetAddress(), node, p.GetState(), inflight, total, failed)
		}
	}
	return tw.Flush()
}

var _ grpc.ClientConnInterface = (*grpc.ClientConn)(nil)
