package main

import (
	"context"
	"fmt"
	"log/slog"

	"golang.org/x/sync/errgroup"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"

	"github.com/csibroker/csibroker/k8sbridge"
	"github.com/csibroker/csibroker/policy"
)

// startGrantController keeps store in step with the cluster's SecretGrant
// objects on every replica (standbys decide with warm rules); only the
// leader writes their status.
func startGrantController(ctx context.Context, g *errgroup.Group, cfg *rest.Config, store *policy.Store, b *k8sbridge.Bridge, log *slog.Logger) error {
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return fmt.Errorf("SecretGrant controller: %w", err)
	}
	gc := k8sbridge.NewGrantController(dyn, store, log, func() bool {
		leading, _ := b.Leader()
		return leading
	})
	g.Go(func() error { return gc.Run(ctx) })
	return nil
}
