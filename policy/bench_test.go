package policy

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"
)

// benchDrivers are the CSI drivers of a mid-sized cluster.
var benchDrivers = []string{
	"ebs.csi.aws.com", "efs.csi.aws.com", "nfs.csi.k8s.io", "smb.csi.k8s.io",
	"rbd.csi.ceph.com", "cephfs.csi.ceph.com", "secrets-store.csi.k8s.io", "hostpath.csi.k8s.io",
}

// benchRules builds n grants spread over namespaces (perNS grants each):
// mostly exact secret names, some prefixes and wildcards, namespace lists
// and selectors, storage classes, one grant in five with a CEL condition,
// one in twenty a Deny grant. It also returns requests: half aimed at a
// grant's (namespace, driver, secret), half arbitrary.
func benchRules(n, perNS int, rng *rand.Rand) ([]Grant, []Request) {
	pick := func(list []string) string { return list[rng.IntN(len(list))] }
	ops := Operations()
	var grants []Grant
	for i := range n {
		ns := fmt.Sprintf("ns-%03d", i/perNS)
		s := GrantSpec{Drivers: []string{pick(benchDrivers)}}
		if rng.IntN(10) == 0 {
			s.Drivers = append(s.Drivers, pick(benchDrivers))
		}
		switch r := rng.IntN(10); {
		case r < 7:
			s.SecretNames = []string{fmt.Sprintf("secret-%d", i), fmt.Sprintf("secret-%d-b", i)}
		case r < 9:
			s.SecretNames = []string{fmt.Sprintf("tenant-%d-*", i%50)}
		default:
			s.SecretNames = []string{"*"}
		}
		if rng.IntN(5) == 0 {
			s.Operations = []Operation{AnyOperation}
		} else {
			for range 1 + rng.IntN(4) {
				s.Operations = append(s.Operations, ops[rng.IntN(len(ops))])
			}
		}
		if rng.IntN(10) < 7 {
			for range 1 + rng.IntN(5) {
				s.Requesters.Namespaces = append(s.Requesters.Namespaces, fmt.Sprintf("app-%02d", rng.IntN(50)))
			}
		} else {
			s.Requesters.NamespaceSelector = &LabelSelector{
				MatchLabels:      map[string]string{"team": fmt.Sprintf("t%d", rng.IntN(10))},
				MatchExpressions: []LabelSelectorRequirement{{Key: "env", Operator: LabelSelectorOpNotIn, Values: []string{"sandbox"}}},
			}
		}
		if rng.IntN(10) < 3 {
			s.Requesters.StorageClasses = []string{"fast", "standard"}
		}
		if rng.IntN(5) == 0 {
			s.Condition = `request.requester.labels["app"] != "untrusted" && request.requester.node.startsWith("node-")`
		}
		if rng.IntN(20) == 0 {
			s.Action = ActionDeny
			s.Condition = `request.requester.namespaceLabels["env"] == "quarantine"`
		}
		grants = append(grants, Grant{Namespace: ns, Name: fmt.Sprintf("grant-%d", i), Spec: s})
	}

	reqs := make([]Request, 4096)
	for i := range reqs {
		r := Request{
			Driver:    pick(benchDrivers),
			Operation: ops[rng.IntN(len(ops))],
			Secret:    SecretRef{Namespace: fmt.Sprintf("ns-%03d", rng.IntN(n/perNS+1)), Name: fmt.Sprintf("secret-%d", rng.IntN(n))},
			Source:    Source{Kind: SourceStorageClassParameter, Key: "csi.storage.k8s.io/node-stage-secret-name"},
			Requester: Requester{
				Kind: KindPersistentVolumeClaim, Namespace: fmt.Sprintf("app-%02d", rng.IntN(50)), Name: fmt.Sprintf("pvc-%d", i),
				NamespaceLabels: map[string]string{"team": fmt.Sprintf("t%d", rng.IntN(10)), "env": "prod", "kubernetes.io/metadata.name": "x"},
				Labels:          map[string]string{"app": "db", "app.kubernetes.io/part-of": "shop"},
				StorageClass:    "fast",
				Node:            fmt.Sprintf("node-%d", rng.IntN(100)),
			},
		}
		if i%2 == 0 { // aim at a grant
			g := grants[rng.IntN(len(grants))]
			r.Secret.Namespace, r.Driver = g.Namespace, g.Spec.Drivers[0]
			r.Secret.Name = g.Spec.SecretNames[0]
			if r.Secret.Name == "*" || r.Secret.Name[len(r.Secret.Name)-1] == '*' {
				r.Secret.Name = r.Secret.Name[:len(r.Secret.Name)-1] + "x"
			}
			if g.Spec.Operations[0] != AnyOperation {
				r.Operation = g.Spec.Operations[0]
			}
			if len(g.Spec.Requesters.Namespaces) > 0 {
				r.Requester.Namespace = g.Spec.Requesters.Namespaces[0]
			}
		}
		reqs[i] = r
	}
	return grants, reqs
}

// BenchmarkDecide times RuleSet.Decide over 1,000 grants. Besides ns/op it
// reports percentiles of per-call latency measured around each call (the
// clock reads add a few tens of ns to each sample).
func BenchmarkDecide(b *testing.B) {
	for _, shape := range []struct {
		name  string
		perNS int
	}{
		{"1000rules-100ns", 10}, // 100 namespaces, 10 grants each
		{"1000rules-10ns", 100}, // 10 namespaces, 100 grants each
		{"1000rules-1ns", 1000}, // every grant in one namespace
	} {
		b.Run(shape.name, func(b *testing.B) {
			rng := rand.New(rand.NewPCG(1, 2))
			grants, reqs := benchRules(1000, shape.perNS, rng)
			rs, errs := Compile(grants)
			if len(errs) > 0 {
				b.Fatal(errs[0])
			}
			allowed := 0
			for _, r := range reqs {
				if rs.Decide(r).Allowed {
					allowed++
				}
			}
			samples := make([]time.Duration, b.N)
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				req := reqs[i&(len(reqs)-1)]
				start := time.Now()
				d := rs.Decide(req)
				samples[i] = time.Since(start)
				_ = d
			}
			b.StopTimer()
			slices.Sort(samples)
			pct := func(p float64) float64 { return float64(samples[int(float64(len(samples)-1)*p)].Nanoseconds()) }
			b.ReportMetric(pct(0.50), "p50-ns")
			b.ReportMetric(pct(0.99), "p99-ns")
			b.ReportMetric(pct(0.999), "p99.9-ns")
			b.ReportMetric(float64(allowed)/float64(len(reqs))*100, "%allowed")
		})
	}
}

// BenchmarkDecideParallel: decisions from every core against one Store.
func BenchmarkDecideParallel(b *testing.B) {
	grants, reqs := benchRules(1000, 10, rand.New(rand.NewPCG(1, 2)))
	s := NewStore(nil)
	if errs := s.Update(grants); len(errs) > 0 {
		b.Fatal(errs[0])
	}
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		i := 0
		for pb.Next() {
			s.Decide(reqs[i&(len(reqs)-1)])
			i++
		}
	})
}

// BenchmarkCompile: a full recompile of 1,000 grants, cold and with the
// previous rule set's conditions reused (Store.Update).
func BenchmarkCompile(b *testing.B) {
	grants, _ := benchRules(1000, 10, rand.New(rand.NewPCG(1, 2)))
	// Give every conditional grant its own condition text, as real rules would.
	for i := range grants {
		if grants[i].Spec.Condition != "" {
			grants[i].Spec.Condition += fmt.Sprintf(` && request.requester.name != "x%d"`, i)
		}
	}
	b.Run("cold", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			Compile(grants)
		}
	})
	b.Run("reuse", func(b *testing.B) {
		prev, _ := Compile(grants)
		b.ReportAllocs()
		for b.Loop() {
			Compile(grants, WithPrevious(prev))
		}
	})
}
