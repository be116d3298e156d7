// Package k8sbridge holds the Kubernetes side of csibroker: informers and
// controllers (provisioning, with clone and snapshot-restore protection,
// and deletion; attach/detach; expansion; volume modification; capacity),
// secret resolution through policy, topology, Events and leader election.
//
// It reaches drivers only through small interfaces that broker satisfies.
package k8sbridge
