package deploy

import (
	"context"
	"fmt"
	"slices"
	"sort"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	authorizationv1 "k8s.io/api/authorization/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csibroker/csibroker/internal/testenv"
)

// grantKey is one (API group, resource[/subresource], resourceName) a rule
// covers; resourceName is "" when the rule is not limited by name.
type grantKey struct{ group, resource, name string }

func (k grantKey) String() string {
	g := k.group
	if g == "" {
		g = "core"
	}
	if k.name != "" {
		return fmt.Sprintf("%s/%s[%s]", g, k.resource, k.name)
	}
	return g + "/" + k.resource
}

// effectiveGrants flattens rules into grantKey → sorted verbs, failing on
// any wildcard or non-resource URL.
func effectiveGrants(t *testing.T, what string, rules []rbacv1.PolicyRule) map[grantKey][]string {
	t.Helper()
	out := map[grantKey][]string{}
	for i, r := range rules {
		if len(r.NonResourceURLs) > 0 {
			t.Errorf("%s rule %d: non-resource URLs %v", what, i, r.NonResourceURLs)
		}
		for _, list := range [][]string{r.APIGroups, r.Resources, r.Verbs, r.ResourceNames} {
			if slices.Contains(list, "*") {
				t.Errorf("%s rule %d: wildcard in %+v", what, i, r)
			}
		}
		names := r.ResourceNames
		if len(names) == 0 {
			names = []string{""}
		}
		for _, g := range r.APIGroups {
			for _, res := range r.Resources {
				for _, n := range names {
					k := grantKey{g, res, n}
					for _, v := range r.Verbs {
						if !slices.Contains(out[k], v) {
							out[k] = append(out[k], v)
						}
					}
					sort.Strings(out[k])
				}
			}
		}
	}
	return out
}

func sorted(s ...string) []string {
	s = slices.Clone(s)
	sort.Strings(s)
	return s
}

// The broker's RBAC is exactly what it needs: the ClusterRole and Role grant
// these verbs and nothing else, and Secrets are "get" only.
func TestRBACLeastPrivilege(t *testing.T) {
	objs := build(t, "base")
	read := sorted("get", "list", "watch")

	t.Run("ClusterRole", func(t *testing.T) {
		cr := typed[rbacv1.ClusterRole](t, find(t, objs, "ClusterRole", "", "csibroker"))
		if cr.AggregationRule != nil {
			t.Error("the ClusterRole must not aggregate other roles")
		}
		got := effectiveGrants(t, "ClusterRole", cr.Rules)
		want := map[grantKey][]string{
			{"", "persistentvolumes", ""}:                                              sorted("get", "list", "watch", "create", "patch", "delete"),
			{"", "persistentvolumeclaims", ""}:                                         sorted("get", "list", "watch", "patch"),
			{"", "persistentvolumeclaims/status", ""}:                                  sorted("patch"),
			{"", "nodes", ""}:                                                          read,
			{"", "namespaces", ""}:                                                     read,
			{"", "pods", ""}:                                                           sorted("list", "watch"),
			{"storage.k8s.io", "storageclasses", ""}:                                   sorted("list", "watch"),
			{"storage.k8s.io", "csinodes", ""}:                                         read,
			{"storage.k8s.io", "volumeattributesclasses", ""}:                          {"get"},
			{"snapshot.storage.k8s.io", "volumesnapshots", ""}:                         sorted("get", "list", "patch"),
			{"snapshot.storage.k8s.io", "volumesnapshotcontents", ""}:                  sorted("get", "list", "watch", "patch"),
			{"snapshot.storage.k8s.io", "volumesnapshotcontents/status", ""}:           sorted("patch"),
			{"snapshot.storage.k8s.io", "volumesnapshotclasses", ""}:                   sorted("list", "watch"),
			{"groupsnapshot.storage.k8s.io", "volumegroupsnapshotcontents", ""}:        sorted("get", "list", "watch", "patch"),
			{"groupsnapshot.storage.k8s.io", "volumegroupsnapshotcontents/status", ""}: sorted("patch"),
			{"groupsnapshot.storage.k8s.io", "volumegroupsnapshotclasses", ""}:         sorted("list", "watch"),
			{"storage.k8s.io", "volumeattachments", ""}:                                sorted("list", "watch", "patch"),
			{"storage.k8s.io", "volumeattachments/status", ""}:                         sorted("patch"),
			{"", "events", ""}:                                                         sorted("create", "patch"),
			{"policy.csibroker.io", "secretgrants", ""}:                                sorted("list", "watch"),
			{"policy.csibroker.io", "secretgrants/status", ""}:                         sorted("patch"),
			{"", "secrets", ""}:                                                        {"get"},
		}
		compareGrants(t, got, want)

		// The point of it all, asserted on its own.
		for k, verbs := range got {
			if k.group == "" && strings.HasPrefix(k.resource, "secrets") && !slices.Equal(verbs, []string{"get"}) {
				t.Errorf("Secrets: the broker may only get them, one named secret at a time; %s grants %v", k, verbs)
			}
		}
	})

	t.Run("Role", func(t *testing.T) {
		role := typed[rbacv1.Role](t, find(t, objs, "Role", brokerNamespace, "csibroker"))
		got := effectiveGrants(t, "Role", role.Rules)
		want := map[grantKey][]string{
			{"coordination.k8s.io", "leases", ""}:                  {"create"},
			{"coordination.k8s.io", "leases", "csibroker-leader"}:  sorted("get", "update"),
			{"", "configmaps", ""}:                                 {"create"},
			{"", "configmaps", "csibroker-intents"}:                sorted("get", "update"),
			{"", "configmaps", "csibroker-snapshot-intents"}:       sorted("get", "update"),
			{"", "configmaps", "csibroker-group-snapshot-intents"}: sorted("get", "update"),
			{"storage.k8s.io", "csistoragecapacities", ""}:         sorted("list", "watch", "create", "update", "delete"),
		}
		compareGrants(t, got, want)
	})

	t.Run("bindings name the broker's service account", func(t *testing.T) {
		dep := typed[appsv1.Deployment](t, find(t, objs, "Deployment", brokerNamespace, "csibroker"))
		sa := dep.Spec.Template.Spec.ServiceAccountName
		find(t, objs, "ServiceAccount", brokerNamespace, sa)
		want := []rbacv1.Subject{{Kind: "ServiceAccount", Name: sa, Namespace: brokerNamespace}}
		crb := typed[rbacv1.ClusterRoleBinding](t, find(t, objs, "ClusterRoleBinding", "", "csibroker"))
		if !slices.Equal(crb.Subjects, want) || crb.RoleRef != (rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: "csibroker"}) {
			t.Errorf("ClusterRoleBinding: subjects %+v roleRef %+v", crb.Subjects, crb.RoleRef)
		}
		rb := typed[rbacv1.RoleBinding](t, find(t, objs, "RoleBinding", brokerNamespace, "csibroker"))
		if !slices.Equal(rb.Subjects, want) || rb.RoleRef != (rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: "csibroker"}) {
			t.Errorf("RoleBinding: subjects %+v roleRef %+v", rb.Subjects, rb.RoleRef)
		}
	})
}

func compareGrants(t *testing.T, got, want map[grantKey][]string) {
	t.Helper()
	for k, v := range want {
		if !slices.Equal(got[k], v) {
			t.Errorf("%s: got verbs %v, want %v", k, got[k], v)
		}
	}
	for k, v := range got {
		if _, ok := want[k]; !ok {
			t.Errorf("%s: granted %v, which the broker does not need", k, v)
		}
	}
}

// The real authorizer agrees: with the base's RBAC created for real, the
// broker's service account may do what the broker does and may not list or
// watch Secrets, or touch what it does not own.
func TestRBACSubjectAccessReview(t *testing.T) {
	c := prepare(t)
	env := testenv.Shared(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*waitTimeout)
	defer cancel()

	objs := build(t, "base")
	for _, kind := range []string{"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"} {
		for _, o := range ofKind(objs, kind) {
			ri, err := c.resource(o)
			if err != nil {
				t.Fatal(err)
			}
			if err := apply(ctx, ri, o, false); err != nil {
				t.Fatalf("create %s: %v", describe(o), err)
			}
		}
	}

	user := "system:serviceaccount:" + brokerNamespace + ":csibroker"
	groups := []string{"system:serviceaccounts", "system:serviceaccounts:" + brokerNamespace, "system:authenticated"}
	type access struct {
		verb, group, resource, subresource, namespace, name string
	}
	can := func(ctx context.Context, a access) (bool, string, error) {
		sar, err := env.Client().AuthorizationV1().SubjectAccessReviews().Create(ctx, &authorizationv1.SubjectAccessReview{
			Spec: authorizationv1.SubjectAccessReviewSpec{
				User: user, Groups: groups,
				ResourceAttributes: &authorizationv1.ResourceAttributes{
					Verb: a.verb, Group: a.group, Resource: a.resource, Subresource: a.subresource, Namespace: a.namespace, Name: a.name,
				},
			},
		}, metav1.CreateOptions{})
		if err != nil {
			return false, "", err
		}
		return sar.Status.Allowed, sar.Status.Reason + sar.Status.EvaluationError, nil
	}

	allowed := []access{
		{verb: "get", resource: "secrets", namespace: "sample-storage", name: "sample-provisioner-creds"},
		{verb: "get", resource: "secrets", namespace: "team-a", name: "anything"},
		{verb: "create", resource: "persistentvolumes", name: "pvc-1"},
		{verb: "delete", resource: "persistentvolumes", name: "pvc-1"},
		{verb: "watch", resource: "persistentvolumeclaims"},
		{verb: "patch", resource: "persistentvolumeclaims", namespace: "sample-app", name: "data"},
		{verb: "patch", resource: "persistentvolumeclaims", subresource: "status", namespace: "sample-app", name: "data"},
		{verb: "list", resource: "pods"},
		{verb: "watch", group: "storage.k8s.io", resource: "csinodes"},
		{verb: "patch", group: "storage.k8s.io", resource: "volumeattachments", subresource: "status", name: "csi-1"},
		{verb: "patch", group: "storage.k8s.io", resource: "volumeattachments", name: "csi-1"},
		{verb: "patch", resource: "persistentvolumes", name: "pvc-1"},
		{verb: "create", group: "storage.k8s.io", resource: "csistoragecapacities", namespace: brokerNamespace},
		{verb: "create", resource: "events", namespace: "sample-app"},
		{verb: "watch", group: "policy.csibroker.io", resource: "secretgrants"},
		{verb: "patch", group: "policy.csibroker.io", resource: "secretgrants", subresource: "status", namespace: "sample-storage", name: "sample-provisioner"},
		{verb: "get", resource: "namespaces", name: "sample-app"},
		{verb: "create", group: "coordination.k8s.io", resource: "leases", namespace: brokerNamespace},
		{verb: "update", group: "coordination.k8s.io", resource: "leases", namespace: brokerNamespace, name: "csibroker-leader"},
		{verb: "get", resource: "configmaps", namespace: brokerNamespace, name: "csibroker-intents"},
		{verb: "update", resource: "configmaps", namespace: brokerNamespace, name: "csibroker-intents"},
		{verb: "get", resource: "configmaps", namespace: brokerNamespace, name: "csibroker-snapshot-intents"},
		{verb: "update", resource: "configmaps", namespace: brokerNamespace, name: "csibroker-snapshot-intents"},
		{verb: "watch", group: "snapshot.storage.k8s.io", resource: "volumesnapshotcontents"},
		{verb: "patch", group: "snapshot.storage.k8s.io", resource: "volumesnapshotcontents", subresource: "status", name: "snapcontent-1"},
		{verb: "watch", group: "snapshot.storage.k8s.io", resource: "volumesnapshotclasses"},
		{verb: "update", resource: "configmaps", namespace: brokerNamespace, name: "csibroker-group-snapshot-intents"},
		{verb: "watch", group: "groupsnapshot.storage.k8s.io", resource: "volumegroupsnapshotcontents"},
		{verb: "patch", group: "groupsnapshot.storage.k8s.io", resource: "volumegroupsnapshotcontents", subresource: "status", name: "groupsnapcontent-1"},
		{verb: "watch", group: "groupsnapshot.storage.k8s.io", resource: "volumegroupsnapshotclasses"},
	}
	denied := []access{
		{verb: "delete", group: "snapshot.storage.k8s.io", resource: "volumesnapshotcontents", name: "snapcontent-1"},
		{verb: "create", group: "snapshot.storage.k8s.io", resource: "volumesnapshotcontents"},
		{verb: "delete", group: "groupsnapshot.storage.k8s.io", resource: "volumegroupsnapshotcontents", name: "groupsnapcontent-1"},
		{verb: "create", group: "groupsnapshot.storage.k8s.io", resource: "volumegroupsnapshots", namespace: "sample-app"},
		{verb: "update", group: "snapshot.storage.k8s.io", resource: "volumesnapshotclasses", name: "c"},
		{verb: "list", resource: "secrets"},
		{verb: "list", resource: "secrets", namespace: "sample-storage"},
		{verb: "watch", resource: "secrets"},
		{verb: "watch", resource: "secrets", namespace: "sample-storage"},
		{verb: "create", resource: "secrets", namespace: brokerNamespace},
		{verb: "update", resource: "secrets", namespace: brokerNamespace, name: "csibroker-broker-tls"},
		{verb: "delete", resource: "persistentvolumeclaims", namespace: "sample-app", name: "data"},
		{verb: "create", resource: "pods", namespace: brokerNamespace},
		{verb: "create", resource: "pods", subresource: "exec", namespace: brokerNamespace, name: "x"},
		{verb: "update", resource: "nodes", name: "node-1"},
		{verb: "update", group: "policy.csibroker.io", resource: "secretgrants", namespace: "sample-storage", name: "sample-provisioner"},
		{verb: "delete", group: "storage.k8s.io", resource: "volumeattachments", name: "csi-1"},
		{verb: "update", group: "coordination.k8s.io", resource: "leases", namespace: brokerNamespace, name: "someone-elses-lease"},
		{verb: "update", group: "coordination.k8s.io", resource: "leases", namespace: "kube-system", name: "csibroker-leader"},
		{verb: "update", resource: "configmaps", namespace: brokerNamespace, name: "other"},
		{verb: "list", resource: "configmaps", namespace: brokerNamespace},
		{verb: "get", resource: "configmaps", namespace: "kube-system", name: "csibroker-intents"},
		{verb: "create", group: "rbac.authorization.k8s.io", resource: "clusterrolebindings"},
		{verb: "delete", group: "storage.k8s.io", resource: "csistoragecapacities", namespace: "other-driver", name: "csisc-1"},
		{verb: "update", resource: "persistentvolumeclaims", namespace: "sample-app", name: "data"},
		{verb: "update", resource: "persistentvolumeclaims", subresource: "status", namespace: "sample-app", name: "data"},
		{verb: "update", group: "storage.k8s.io", resource: "volumeattachments", subresource: "status", name: "csi-1"},
		{verb: "update", group: "storage.k8s.io", resource: "volumeattachments", name: "csi-1"},
		{verb: "update", resource: "persistentvolumes", name: "pvc-1"},
		{verb: "get", resource: "pods", namespace: "sample-storage", name: "proxy-0"},
		{verb: "update", group: "policy.csibroker.io", resource: "secretgrants", subresource: "status", namespace: "sample-storage", name: "sample-provisioner"},
		{verb: "patch", group: "storage.k8s.io", resource: "csistoragecapacities", namespace: brokerNamespace, name: "csisc-1"},
	}

	// RBAC objects reach the authorizer through its informers.
	first := allowed[0]
	err := testenv.WaitFor(ctx, waitTimeout, "the broker's RBAC to take effect", func(ctx context.Context) (bool, string, error) {
		ok, reason, err := can(ctx, first)
		return ok, reason, err
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range allowed {
		if ok, reason, err := can(ctx, a); err != nil || !ok {
			t.Errorf("%+v: want allowed, got %v (%s) %v", a, ok, reason, err)
		}
	}
	for _, a := range denied {
		if ok, reason, err := can(ctx, a); err != nil || ok {
			t.Errorf("%+v: want denied, got allowed=%v (%s) %v", a, ok, reason, err)
		}
	}
}

// The per-driver install adds one Role, for the member and driver Leases
// in the broker's namespace, bound to the broker, and runs three replicas
// with --leader-election-mode=per-driver; the rest is the install's.
func TestPerDriverInstall(t *testing.T) {
	objs := build(t, "per-driver")
	role := typed[rbacv1.Role](t, find(t, objs, "Role", brokerNamespace, "csibroker-per-driver"))
	compareGrants(t, effectiveGrants(t, "per-driver Role", role.Rules), map[grantKey][]string{
		{"coordination.k8s.io", "leases", ""}: sorted("get", "list", "update", "watch"),
	})
	rb := typed[rbacv1.RoleBinding](t, find(t, objs, "RoleBinding", brokerNamespace, "csibroker-per-driver"))
	dep := typed[appsv1.Deployment](t, find(t, objs, "Deployment", brokerNamespace, "csibroker"))
	want := []rbacv1.Subject{{Kind: "ServiceAccount", Name: dep.Spec.Template.Spec.ServiceAccountName, Namespace: brokerNamespace}}
	if !slices.Equal(rb.Subjects, want) || rb.RoleRef != (rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: "csibroker-per-driver"}) {
		t.Errorf("RoleBinding: subjects %+v roleRef %+v", rb.Subjects, rb.RoleRef)
	}
	if dep.Spec.Replicas == nil || *dep.Spec.Replicas != 3 {
		t.Errorf("replicas %v, want 3", dep.Spec.Replicas)
	}
	cmd := parseCommand(t, "per-driver broker", container(t, dep.Spec.Template.Spec, "broker"), brokerFlags)
	if cmd.flags["leader-election"] != "true" || cmd.flags["leader-election-mode"] != "per-driver" {
		t.Errorf("flags %v: want --leader-election and --leader-election-mode=per-driver", cmd.flags)
	}
	// The base Role, unchanged, still grants what the single Lease needs.
	base := typed[rbacv1.Role](t, find(t, objs, "Role", brokerNamespace, "csibroker"))
	if got := effectiveGrants(t, "Role", base.Rules)[grantKey{"coordination.k8s.io", "leases", ""}]; !slices.Equal(got, []string{"create"}) {
		t.Errorf("base Role grants %v on leases, want create", got)
	}
}
