package intent

import (
	"encoding/json"
	"log/slog"
	"sort"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/proto"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// FuzzDecodeIntents feeds the intent record's entries, as read back from
// the API server (anyone who may edit the ConfigMap can write them), to
// decodeIntents and what recovery does with an entry: nothing may panic,
// unreadable entries are left out (logged for an admin), the rest come
// sorted by key, and their requests decode or fail without panicking.
func FuzzDecodeIntents(f *testing.F) {
	req, _ := proto.Marshal(&csi.CreateVolumeRequest{Name: "pvc-1", Parameters: map[string]string{"type": "ssd"}})
	good := Intent{VolumeName: "pvc-1", Driver: "d.csi", ClaimNamespace: "ns", ClaimName: "c", ClaimUID: "u", Request: req,
		EarlierRequests: [][]byte{req}, ProvisionerSecret: &corev1.SecretReference{Name: "s", Namespace: "ns"}}
	f.Add(encodeForFuzz(good), `{"volumeName": 1}`)
	f.Add(`{"volumeName":"v","request":"AAAA","earlierRequests":["////"]}`, `null`)
	f.Add(`{"namespaceLabels":{"a":"b"},"claimLabels":null}`, `[]`)
	f.Add(`{`, `{"request": "not base64!"}`)
	f.Fuzz(func(t *testing.T, a, b string) {
		cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "csibroker-intents", Namespace: "ns"},
			Data: map[string]string{"a": a, "b": b}}
		ins := decodeIntents[Intent](cm, slog.New(slog.DiscardHandler))
		if len(ins) > 2 {
			t.Fatalf("%d intents from 2 entries", len(ins))
		}
		if !sort.SliceIsSorted(ins, func(i, j int) bool { return ins[i].Key() < ins[j].Key() }) {
			t.Fatal("intents not sorted by key")
		}
		for _, in := range ins {
			for _, raw := range in.Requests() {
				_ = proto.Unmarshal(raw, &csi.CreateVolumeRequest{})
			}
		}
	})
}

// encodeForFuzz is an entry as the store writes it.
func encodeForFuzz(in Intent) string {
	b, err := json.Marshal(in)
	if err != nil {
		panic(err)
	}
	return string(b)
}
