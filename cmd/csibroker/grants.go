package main

import (
	"fmt"
	"log/slog"

	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"

	"github.com/csibroker/csibroker/k8sbridge"
	"github.com/csibroker/csibroker/k8sbridge/grants"
	"github.com/csibroker/csibroker/policy"
)

// newGrantController makes the controller that keeps store in step with the
// cluster's SecretGrant objects on every replica (standbys decide with warm
// rules); only the leader writes their status.
func newGrantController(cfg *rest.Config, store *policy.Store, b *k8sbridge.Bridge, log *slog.Logger) (*grants.Controller, error) {
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("SecretGrant controller: %w", err)
	}
	return grants.NewController(dyn, store, log, func() bool {
		leading, _ := b.Leader()
		return leading
	}), nil
}
