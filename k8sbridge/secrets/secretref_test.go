package secrets

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csibroker/csibroker/policy"
)

func TestSecretParamKeys(t *testing.T) {
	want := map[Kind][4]string{
		Provisioner: {"csi.storage.k8s.io/provisioner-secret-name", "csi.storage.k8s.io/provisioner-secret-namespace",
			"csiProvisionerSecretName", "csiProvisionerSecretNamespace"},
		ControllerPublish: {"csi.storage.k8s.io/controller-publish-secret-name", "csi.storage.k8s.io/controller-publish-secret-namespace",
			"csiControllerPublishSecretName", "csiControllerPublishSecretNamespace"},
		NodeStage: {"csi.storage.k8s.io/node-stage-secret-name", "csi.storage.k8s.io/node-stage-secret-namespace",
			"csiNodeStageSecretName", "csiNodeStageSecretNamespace"},
		NodePublish: {"csi.storage.k8s.io/node-publish-secret-name", "csi.storage.k8s.io/node-publish-secret-namespace",
			"csiNodePublishSecretName", "csiNodePublishSecretNamespace"},
		ControllerExpand: {"csi.storage.k8s.io/controller-expand-secret-name", "csi.storage.k8s.io/controller-expand-secret-namespace", "", ""},
		NodeExpand:       {"csi.storage.k8s.io/node-expand-secret-name", "csi.storage.k8s.io/node-expand-secret-namespace", "", ""},
		ControllerModify: {"csi.storage.k8s.io/controller-modify-secret-name", "csi.storage.k8s.io/controller-modify-secret-namespace", "", ""},
		Kind("bogus"):    {"", "", "", ""},
	}
	if len(Kinds()) != 7 {
		t.Errorf("Kinds() = %v, want the 7 kinds", Kinds())
	}
	for _, k := range Kinds() {
		if _, ok := want[k]; !ok {
			t.Errorf("Kinds() has %q, not in this test", k)
		}
	}
	for kind, w := range want {
		name, ns := ParamKeys(kind)
		dName, dNS := DeprecatedParamKeys(kind)
		if got := [4]string{name, ns, dName, dNS}; got != w {
			t.Errorf("%s: keys %q, want %q", kind, got, w)
		}
	}
}

func pureClaim() *corev1.PersistentVolumeClaim {
	return &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{
		Name:      "data-web-0",
		Namespace: "team-a",
		Annotations: map[string]string{
			"team.example.com/key": "blue-key",
			"upper":                "NotADNSName",
			"empty":                "",
		},
	}}
}

const purePV = "pvc-0a1b2c3d"

func TestSecretRef(t *testing.T) {
	const (
		provName = "csi.storage.k8s.io/provisioner-secret-name"
		provNS   = "csi.storage.k8s.io/provisioner-secret-namespace"
		npName   = "csi.storage.k8s.io/node-publish-secret-name"
		npNS     = "csi.storage.k8s.io/node-publish-secret-namespace"
	)
	type tc struct {
		name    string
		kind    Kind
		params  map[string]string
		noClaim bool
		want    string   // "namespace/name", or "" for no reference
		errHas  []string // the error must contain each of these
	}
	cases := []tc{
		// Which parameters name the secret.
		{name: "no parameters: no secret", kind: Provisioner, params: nil},
		{name: "other kinds' parameters only: no secret", kind: NodeStage,
			params: map[string]string{provName: "s", provNS: "ns"}},
		{name: "deprecated keys", kind: Provisioner,
			params: map[string]string{"csiProvisionerSecretName": "s", "csiProvisionerSecretNamespace": "ns"}, want: "ns/s"},
		{name: "deprecated name with current namespace key", kind: NodeStage,
			params: map[string]string{"csiNodeStageSecretName": "s", "csi.storage.k8s.io/node-stage-secret-namespace": "ns"}, want: "ns/s"},
		{name: "expand kinds have no deprecated keys", kind: ControllerExpand,
			params: map[string]string{"csiControllerExpandSecretName": "s", "csiControllerExpandSecretNamespace": "ns"}},
		{name: "deprecated and current name keys together", kind: Provisioner,
			params: map[string]string{"csiProvisionerSecretName": "s", provName: "s", provNS: "ns"},
			errHas: []string{"csiProvisionerSecretName", provName, "twice"}},
		{name: "deprecated and current namespace keys together", kind: Provisioner,
			params: map[string]string{"csiProvisionerSecretNamespace": "ns", provName: "s", provNS: "ns"},
			errHas: []string{"csiProvisionerSecretNamespace", provNS, "twice"}},
		{name: "name without namespace", kind: NodePublish, params: map[string]string{npName: "s"},
			errHas: []string{npName, npNS, "together"}},
		{name: "namespace without name", kind: NodePublish, params: map[string]string{npNS: "ns"},
			errHas: []string{npNS, npName, "together"}},
		{name: "empty name", kind: NodePublish, params: map[string]string{npName: "", npNS: "ns"},
			errHas: []string{npName, "empty"}},
		{name: "empty namespace", kind: NodePublish, params: map[string]string{npName: "s", npNS: ""},
			errHas: []string{npNS, "empty"}},
		{name: "default keys when the kind sets none", kind: NodeExpand,
			params: map[string]string{ParamDefaultSecretName: "common", ParamDefaultSecretNamespace: "creds"}, want: "creds/common"},
		{name: "the kind's own keys win over the default", kind: NodePublish,
			params: map[string]string{ParamDefaultSecretName: "common", ParamDefaultSecretNamespace: "creds", npName: "own", npNS: "ns"},
			want:   "ns/own"},
		{name: "default keys half set", kind: Provisioner,
			params: map[string]string{ParamDefaultSecretName: "common"},
			errHas: []string{ParamDefaultSecretName, ParamDefaultSecretNamespace, "together"}},
		{name: "the kind's half-set keys are an error even with defaults", kind: Provisioner,
			params: map[string]string{provName: "s", ParamDefaultSecretName: "common", ParamDefaultSecretNamespace: "creds"},
			errHas: []string{provName, provNS}},
		{name: "unknown kind", kind: Kind("snapshotter"), params: map[string]string{provName: "s", provNS: "ns"},
			errHas: []string{"snapshotter"}},

		// Templates allowed in names.
		{name: "name: ${pv.name}", kind: NodePublish,
			params: map[string]string{npName: "${pv.name}", npNS: "ns"}, want: "ns/" + purePV},
		{name: "name: ${pvc.name} and ${pvc.namespace} with literal text", kind: NodePublish,
			params: map[string]string{npName: "${pvc.namespace}.${pvc.name}-key", npNS: "ns"}, want: "ns/team-a.data-web-0-key"},
		{name: "name: ${pvc.annotations['k']}", kind: NodePublish,
			params: map[string]string{npName: "${pvc.annotations['team.example.com/key']}", npNS: "${pvc.namespace}"},
			want:   "team-a/blue-key"},
		{name: "name: provisioner secret may use claim name and annotations (upstream v5+)", kind: Provisioner,
			params: map[string]string{provName: "${pvc.name}-${pvc.annotations['team.example.com/key']}", provNS: "${pvc.namespace}-fast"},
			want:   "team-a-fast/data-web-0-blue-key"},
		{name: "name: every kind resolves the same way", kind: ControllerExpand,
			params: map[string]string{"csi.storage.k8s.io/controller-expand-secret-name": "${pvc.name}",
				"csi.storage.k8s.io/controller-expand-secret-namespace": "${pv.name}"},
			want: purePV + "/data-web-0"},

		// Templates allowed in namespaces.
		{name: "namespace: ${pv.name}", kind: NodeStage,
			params: map[string]string{"csi.storage.k8s.io/node-stage-secret-name": "s", "csi.storage.k8s.io/node-stage-secret-namespace": "${pv.name}"},
			want:   purePV + "/s"},
		{name: "namespace: ${pvc.namespace} with literal text", kind: NodePublish,
			params: map[string]string{npName: "s", npNS: "creds-${pvc.namespace}"}, want: "creds-team-a/s"},
		{name: "namespace: ${pvc.name} is not allowed", kind: NodePublish,
			params: map[string]string{npName: "s", npNS: "${pvc.name}"},
			errHas: []string{npNS, `"${pvc.name}"`, "not allowed", "only ${pv.name} and ${pvc.namespace}"}},
		{name: "namespace: annotations are not allowed", kind: Provisioner,
			params: map[string]string{provName: "s", provNS: "${pvc.annotations['team.example.com/key']}"},
			errHas: []string{provNS, "${pvc.annotations['team.example.com/key']}", "not allowed"}},

		// Bad templates.
		{name: "unknown token", kind: NodePublish,
			params: map[string]string{npName: "${pvc.uid}", npNS: "ns"},
			errHas: []string{npName, `"${pvc.uid}"`, "unknown token ${pvc.uid}"}},
		{name: "unknown token in a namespace lists the namespace tokens", kind: NodePublish,
			params: map[string]string{npName: "s", npNS: "${namespace}"},
			errHas: []string{npNS, "unknown token ${namespace}", "known here: ${pv.name}, ${pvc.namespace})"}},
		{name: "missing annotation", kind: NodePublish,
			params: map[string]string{npName: "${pvc.annotations['absent']}", npNS: "ns"},
			errHas: []string{npName, `no annotation "absent"`, "team-a/data-web-0"}},
		{name: "annotation token with double quotes is unknown", kind: NodePublish,
			params: map[string]string{npName: `${pvc.annotations["team.example.com/key"]}`, npNS: "ns"},
			errHas: []string{npName, "unknown token"}},
		{name: "$ without braces", kind: NodePublish,
			params: map[string]string{npName: "$pv.name", npNS: "ns"},
			errHas: []string{npName, `"$pv.name"`, `"$" must start a ${...} token`}},
		{name: "unterminated ${", kind: NodePublish,
			params: map[string]string{npName: "key-${pv.name", npNS: "ns"},
			errHas: []string{npName, "not closed"}},
		{name: "empty ${}", kind: NodePublish,
			params: map[string]string{npName: "key-${}", npNS: "ns"},
			errHas: []string{npName, "unknown token ${}"}},

		// Resolved values must be valid names.
		{name: "resolved name is not a DNS subdomain", kind: NodePublish,
			params: map[string]string{npName: "${pvc.annotations['upper']}", npNS: "ns"},
			errHas: []string{npName, `resolved to "NotADNSName"`, "not a valid secret name"}},
		{name: "resolved name is empty", kind: NodePublish,
			params: map[string]string{npName: "${pvc.annotations['empty']}", npNS: "ns"},
			errHas: []string{npName, `resolved to ""`, "not a valid secret name"}},
		{name: "literal name is not a DNS subdomain", kind: NodePublish,
			params: map[string]string{npName: "under_score", npNS: "ns"},
			errHas: []string{npName, `"under_score", which is not a valid secret name`}},
		{name: "name too long", kind: NodePublish,
			params: map[string]string{npName: strings.Repeat("a", 250) + "-${pvc.name}", npNS: "ns"},
			errHas: []string{npName, "not a valid secret name", "253"}},
		{name: "namespace with a dot is not a DNS label", kind: NodePublish,
			params: map[string]string{npName: "s", npNS: "${pvc.namespace}.creds"},
			errHas: []string{npNS, `resolved to "team-a.creds"`, "not a valid namespace name"}},

		// Without a claim (deletion).
		{name: "no claim: ${pv.name} resolves", kind: Provisioner, noClaim: true,
			params: map[string]string{provName: "${pv.name}", provNS: "creds"}, want: "creds/" + purePV},
		{name: "no claim: ${pvc.namespace} cannot resolve", kind: Provisioner, noClaim: true,
			params: map[string]string{provName: "s", provNS: "${pvc.namespace}"},
			errHas: []string{provNS, "${pvc.namespace} needs the claim"}},
		{name: "no claim: ${pvc.name} cannot resolve", kind: Provisioner, noClaim: true,
			params: map[string]string{provName: "${pvc.name}", provNS: "creds"},
			errHas: []string{provName, "${pvc.name} needs the claim"}},
		{name: "no claim: annotations cannot resolve", kind: Provisioner, noClaim: true,
			params: map[string]string{provName: "${pvc.annotations['team.example.com/key']}", provNS: "creds"},
			errHas: []string{provName, "needs the claim"}},
	}

	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			claim := pureClaim()
			if c.noClaim {
				claim = nil
			}
			ref, err := Ref(c.kind, c.params, purePV, claim)
			if c.errHas != nil {
				if err == nil {
					t.Fatalf("no error, got %+v", ref)
				}
				if !errors.Is(err, ErrParameter) {
					t.Errorf("error does not wrap ErrParameter: %v", err)
				}
				for _, s := range c.errHas {
					if !strings.Contains(err.Error(), s) {
						t.Errorf("error %q does not contain %q", err, s)
					}
				}
				if ref != nil {
					t.Errorf("reference %+v alongside the error", ref)
				}
				t.Logf("error: %v", err)
				return
			}
			if err != nil {
				t.Fatalf("unexpected error: %v", err)
			}
			got := ""
			if ref != nil {
				got = ref.Namespace + "/" + ref.Name
			}
			if got != c.want {
				t.Errorf("got %q, want %q", got, c.want)
			}
		})
	}
}

// Every kind reads its own pair of keys.
func TestSecretRefEveryKind(t *testing.T) {
	for _, kind := range Kinds() {
		name, ns := ParamKeys(kind)
		params := map[string]string{name: string(kind) + "-${pvc.name}", ns: "${pvc.namespace}"}
		ref, err := Ref(kind, params, purePV, pureClaim())
		if err != nil {
			t.Fatalf("%s: %v", kind, err)
		}
		if want := string(kind) + "-data-web-0"; ref.Name != want || ref.Namespace != "team-a" {
			t.Errorf("%s: got %s/%s, want team-a/%s", kind, ref.Namespace, ref.Name, want)
		}
		for _, other := range Kinds() {
			if other == kind {
				continue
			}
			if ref, err := Ref(other, params, purePV, pureClaim()); ref != nil || err != nil {
				t.Errorf("%s's keys gave %s: %+v, %v", kind, other, ref, err)
			}
		}
	}
}

// TestPolicySourceNamesTheKeysRead: the policy and its audit are told the
// parameter SecretRef actually read, a deprecated one included, and whether
// it was a template.
func TestPolicySourceNamesTheKeysRead(t *testing.T) {
	for _, tc := range []struct {
		params   map[string]string
		kind     policy.SourceKind
		key      string
		template string
	}{
		{map[string]string{"csi.storage.k8s.io/provisioner-secret-name": "s", "csi.storage.k8s.io/provisioner-secret-namespace": "ns"},
			policy.SourceStorageClassParameter, "csi.storage.k8s.io/provisioner-secret-name", ""},
		{map[string]string{"csiProvisionerSecretName": "${pvc.name}", "csiProvisionerSecretNamespace": "ns"},
			policy.SourceTemplate, "csiProvisionerSecretName", "ns/${pvc.name}"},
		{map[string]string{"csiProvisionerSecretName": "s", "csi.storage.k8s.io/provisioner-secret-namespace": "${pvc.namespace}"},
			policy.SourceTemplate, "csiProvisionerSecretName", "${pvc.namespace}/s"},
		// No key of the kind's own: the default keys, as SecretRef reads them.
		{map[string]string{"csi.storage.k8s.io/secret-name": "${pvc.annotations['team']}-creds", "csi.storage.k8s.io/secret-namespace": "ns"},
			policy.SourceTemplate, "csi.storage.k8s.io/secret-name", "ns/${pvc.annotations['team']}-creds"},
		{map[string]string{"csi.storage.k8s.io/secret-name": "creds", "csi.storage.k8s.io/secret-namespace": "ns"},
			policy.SourceStorageClassParameter, "csi.storage.k8s.io/secret-name", ""},
	} {
		got := PolicySource(Provisioner, tc.params)
		if got.Kind != tc.kind || got.Key != tc.key || got.Template != tc.template {
			t.Errorf("%v: %+v, want kind %s key %s template %q", tc.params, got, tc.kind, tc.key, tc.template)
		}
	}
}

// TestSecretRefCutsALongResolvedValue: a template resolved from a claim's
// annotation (up to 256 KiB) is quoted cut, with its length, in the error
// that goes on to the claim's Event and the log.
func TestSecretRefCutsALongResolvedValue(t *testing.T) {
	claim := pureClaim()
	claim.Annotations = map[string]string{"team.example.com/key": strings.Repeat("Ab_", 20000)}
	_, err := Ref(Provisioner, map[string]string{
		"csi.storage.k8s.io/provisioner-secret-name":      "${pvc.annotations['team.example.com/key']}",
		"csi.storage.k8s.io/provisioner-secret-namespace": "creds",
	}, purePV, claim)
	if err == nil || !strings.Contains(err.Error(), "... (60000 bytes)") || !strings.Contains(err.Error(), "not a valid secret name") || len(err.Error()) > 1000 {
		t.Fatalf("error (%d bytes): %.1500v", len(fmt.Sprint(err)), err)
	}
}
