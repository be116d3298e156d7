package k8sbridge

import (
	"github.com/csibroker/csibroker/k8sbridge/internal/drivers"
	"github.com/csibroker/csibroker/k8sbridge/internal/kube"
)

// Config is everything the bridge needs; cmd/ fills it from flags.
type Config = kube.Config

// SecretPolicy decides whether a driver may receive a secret;
// policy.Authorizer satisfies it.
type SecretPolicy = kube.SecretPolicy

// Drivers is what the bridge needs from the broker: connections to each
// driver's controller and node proxies, and its timeouts.
type Drivers = drivers.Drivers
