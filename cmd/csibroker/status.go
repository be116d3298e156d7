package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"slices"
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
	// With per-driver leader election, each driver's leader is a column
	// (and "leader" above is the coordinator's lease).
	perDriver := slices.ContainsFunc(st.GetDrivers(), func(d *brokerstatusv1.DriverStatus) bool { return d.GetLeader() != "" })
	if perDriver {
		leader += " (coordinator; drivers: per-driver leader election)"
	}
	fmt.Fprintf(w, "broker %s, leader: %s\n\n", st.GetVersion(), leader)
	tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', 0)
	head := "DRIVER\tPROXY\tNODE\tSTATE\tIN FLIGHT\tCALLS\tFAILED"
	if perDriver {
		head += "\tLED BY"
	}
	fmt.Fprintln(tw, head)
	for _, d := range st.GetDrivers() {
		for i, p := range d.GetProxies() {
			name, inflight, total, failed, led := d.GetName(), fmt.Sprint(d.GetInflightCalls()), fmt.Sprint(d.GetTotalCalls()), fmt.Sprint(d.GetFailedCalls()), d.GetLeader()
			if led == "" {
				led = "(none)"
			}
			if i > 0 {
				name, inflight, total, failed, led = "", "", "", "", ""
			}
			node := p.GetNode()
			if node == "" {
				node = "(controller)"
			}
			line := fmt.Sprintf("%s\t%s\t%s\t%s\t%s\t%s\t%s", name, p.GetAddress(), node, p.GetState(), inflight, total, failed)
			if perDriver {
				line += "\t" + led
			}
			fmt.Fprintln(tw, line)
		}
	}
	return tw.Flush()
}

var _ grpc.ClientConnInterface = (*grpc.ClientConn)(nil)
