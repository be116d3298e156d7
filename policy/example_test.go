package policy_test

import (
	"fmt"

	"github.com/csibroker/csibroker/policy"
)

// A namespace owner lets the NFS driver stage the team's secret for claims of
// team-a; everything else is denied.
func Example() {
	grants, err := policy.ParseGrants([]byte(`
apiVersion: policy.csibroker.io/v1alpha1
kind: SecretGrant
metadata: {name: nfs-stage, namespace: team-a}
spec:
  drivers: [nfs.csi.example.com]
  secretNames: [nfs-creds]
  operations: [NodeStageVolume]
  requesters: {namespaces: [team-a]}
  condition: request.requester.node.startsWith("storage-")
`))
	if err != nil {
		panic(err)
	}
	rules, errs := policy.Compile(grants) // policy.WithMode(policy.ModeAudit) to roll out
	fmt.Println("invalid grants:", len(errs))

	store := policy.NewStore(rules) // reloads: store.Update(newGrants)
	req := policy.Request{
		Driver:    "nfs.csi.example.com",
		Operation: policy.OpNodeStageVolume,
		Secret:    policy.SecretRef{Namespace: "team-a", Name: "nfs-creds"},
		Source:    policy.Source{Kind: policy.SourceStorageClassParameter, Key: "csi.storage.k8s.io/node-stage-secret-name"},
		Requester: policy.Requester{Kind: policy.KindPersistentVolumeClaim, Namespace: "team-a", Name: "data", Node: "storage-1"},
	}
	d := store.Decide(req)
	fmt.Println(d.Allowed, d.Rule, d.Result())
	fmt.Println(d.Reason)

	req.Requester.Namespace = "team-b"
	d = store.Decide(req)
	fmt.Println(d.Allowed, d.Rule, d.Result())
	fmt.Println(d.Reason)
	// Output:
	// invalid grants: 0
	// true team-a/nfs-stage allow
	// grant team-a/nfs-stage allows driver nfs.csi.example.com receiving secret team-a/nfs-creds for NodeStageVolume on behalf of PersistentVolumeClaim team-a/data
	// false default-deny deny
	// no grant in namespace team-a allows driver nfs.csi.example.com receiving secret team-a/nfs-creds for NodeStageVolume on behalf of PersistentVolumeClaim team-b/data
}
