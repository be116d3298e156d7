package kube

import (
	"errors"
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
)

type Metrics struct {
	Provisions     *prometheus.CounterVec
	ProvisionTime  *prometheus.HistogramVec
	Deletions      *prometheus.CounterVec
	SecretDecision *prometheus.CounterVec
	Leaked         *prometheus.CounterVec
	Attach         *prometheus.CounterVec
	Leader         prometheus.Gauge
	Panics         *prometheus.CounterVec
	WorkItems      *prometheus.CounterVec
	reg            prometheus.Registerer
}

func newMetrics(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{
		Provisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "csibroker", Name: "provision_operations_total",
			Help: "Provisioning attempts by driver, StorageClass and result (success, failed, in_progress, rescheduled).",
		}, []string{"driver", "storage_class", "result"}),
		ProvisionTime: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: "csibroker", Name: "provision_duration_seconds",
			Help:    "Time from picking up a claim to its PV being created, by driver and StorageClass.",
			Buckets: prometheus.ExponentialBucketsRange(1e-3, 600, 20),
		}, []string{"driver", "storage_class"}),
		Deletions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "csibroker", Name: "delete_operations_total",
			Help: "Volume deletions by driver and result (success, failed, blocked).",
		}, []string{"driver", "result"}),
		SecretDecision: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "csibroker", Name: "secret_policy_decisions_total",
			Help: "Secret access decisions by driver, CSI operation and decision (allow, deny, would-deny).",
		}, []string{"driver", "operation", "decision"}),
		Leaked: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "csibroker", Name: "recovered_volumes_total",
			Help: "Volumes created for claims that vanished (or by a broker that died) and deleted by recovery, by driver and result (deleted; failed; stuck: reported for an administrator; abandoned: an attempt's node gone for a week).",
		}, []string{"driver", "result"}),
		Attach: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "csibroker", Name: "attach_operations_total",
			Help: "Attach and detach operations by driver, operation (attach, detach) and result (success, failed).",
		}, []string{"driver", "operation", "result"}),
		Leader: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: "csibroker", Name: "leader",
			Help: "1 while this replica holds the leader lease.",
		}),
		Panics: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "csibroker", Name: "work_item_panics_total",
			Help: "Controller work items that panicked (each failed and was retried; the process went on), by controller.",
		}, []string{"controller"}),
		WorkItems: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "csibroker", Name: "work_items_total",
			Help: "Controller work items handled, by controller and outcome (done; retry: failed, queued again with backoff; requeue: queued again after a wait; waiting: in its driver's line).",
		}, []string{"controller", "outcome"}),
		reg: reg,
	}
	if reg != nil {
		for _, c := range []prometheus.Collector{m.Provisions, m.ProvisionTime, m.Deletions, m.SecretDecision, m.Leaked, m.Attach, m.Leader, m.Panics, m.WorkItems} {
			if err := reg.Register(c); err != nil {
				return nil, err
			}
		}
	}
	return m, nil
}

// QueueDepth exports a workqueue's length.
func (m *Metrics) QueueDepth(name string, length func() int) {
	if m.reg == nil {
		return
	}
	_ = m.reg.Register(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Namespace: "csibroker", Name: "workqueue_depth", Help: "Items waiting in a controller's work queue.",
		ConstLabels: prometheus.Labels{"queue": name},
	}, func() float64 { return float64(length()) }))
}

// OperationsCounter is the csibroker_<name>{driver,result} counter of a
// controller, registered on reg (nil: none); a bridge made again on the
// same registry (a test's, say) shares the one registered first.
func OperationsCounter(reg prometheus.Registerer, name, help string) (*prometheus.CounterVec, error) {
	c := prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "csibroker", Name: name, Help: help}, []string{"driver", "result"})
	if reg == nil {
		return c, nil
	}
	if err := reg.Register(c); err != nil {
		var are prometheus.AlreadyRegisteredError
		if errors.As(err, &are) {
			if existing, ok := are.ExistingCollector.(*prometheus.CounterVec); ok {
				return existing, nil
			}
		}
		return nil, fmt.Errorf("register %s: %w", name, err)
	}
	return c, nil
}
