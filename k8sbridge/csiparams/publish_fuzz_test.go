package csiparams

import (
	"testing"
	"unicode/utf8"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/proto"
)

// FuzzCheckPublished feeds driver ControllerPublishVolume answers (any
// bytes a driver may send, and a context built from raw strings, which an
// in-process driver may hand over undecoded) to the check: nothing may
// panic, and what it accepts is a publish context the API server takes
// as a VolumeAttachment's attachmentMetadata, unchanged by JSON.
func FuzzCheckPublished(f *testing.F) {
	for _, r := range []*csi.ControllerPublishVolumeResponse{
		{PublishContext: map[string]string{"devicePath": "/dev/sdb"}},
		{PublishContext: map[string]string{"": ""}},
		{},
	} {
		b, _ := proto.Marshal(r)
		f.Add(b, "k", "v")
	}
	f.Add([]byte{0x0a, 0x05, 0x0a, 0x01, 0xff, 0x12, 0x00}, "a\xff", "\xc3(")
	f.Fuzz(func(t *testing.T, data []byte, k, v string) {
		var resp csi.ControllerPublishVolumeResponse
		if proto.Unmarshal(data, &resp) == nil {
			checkAccepted(t, resp.GetPublishContext())
		}
		checkAccepted(t, map[string]string{k: v})
	})
}

func checkAccepted(t *testing.T, pc map[string]string) {
	if CheckPublished(pc) != nil {
		return
	}
	size := 0
	for k, v := range pc {
		size += len(k) + len(v)
		if !utf8.ValidString(k) || !utf8.ValidString(v) {
			t.Fatalf("accepted a string that is not UTF-8: %q=%q", k, v)
		}
	}
	if size > MaxPublishContextBytes {
		t.Fatalf("accepted %d bytes", size)
	}
}
