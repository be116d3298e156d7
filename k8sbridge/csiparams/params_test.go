package csiparams

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csibroker/csibroker/k8sbridge/secrets"
)

func TestCreateParameters(t *testing.T) {
	allKnown := map[string]string{
		"type":                              "ssd",
		ParamFSType:                         "xfs",
		secrets.ParamDefaultSecretName:      "s",
		secrets.ParamDefaultSecretNamespace: "ns",
	}
	for _, k := range secrets.Kinds() {
		name, ns := secrets.ParamKeys(k)
		allKnown[name], allKnown[ns] = "s", "ns"
	}

	cases := []struct {
		name      string
		params    map[string]string
		extra     bool
		noClaim   bool
		want      map[string]string
		wantFS    string
		errHas    []string
		errAbsent []string
	}{
		{name: "no parameters", params: nil, want: map[string]string{}},
		{name: "driver parameters pass through", params: map[string]string{"type": "ssd", "iops": "300"},
			want: map[string]string{"type": "ssd", "iops": "300"}},
		{name: "every known csi.storage.k8s.io/ key is stripped", params: allKnown,
			want: map[string]string{"type": "ssd"}, wantFS: "xfs"},
		{name: "deprecated fstype key is read and kept for the driver", params: map[string]string{"fsType": "ext4", "type": "ssd"},
			want: map[string]string{"fsType": "ext4", "type": "ssd"}, wantFS: "ext4"},
		{name: "deprecated secret keys are kept for the driver",
			params: map[string]string{"csiProvisionerSecretName": "s", "csiProvisionerSecretNamespace": "ns"},
			want:   map[string]string{"csiProvisionerSecretName": "s", "csiProvisionerSecretNamespace": "ns"}},
		{name: "fstype twice: prefixed and deprecated", params: map[string]string{ParamFSType: "xfs", "fstype": "ext4"},
			errHas: []string{ParamFSType, "fstype", "more than once"}},
		{name: "fstype twice: two spellings of the deprecated key", params: map[string]string{"FSTYPE": "xfs", "fsType": "ext4"},
			errHas: []string{"FSTYPE", "fsType"}},
		{name: "unknown csi.storage.k8s.io/ key", params: map[string]string{"type": "ssd", secrets.ParameterPrefix + "fs-type": "xfs"},
			errHas: []string{`csi.storage.k8s.io/fs-type`, "reserved"}, errAbsent: []string{"ssd", "xfs"}},
		{name: "several unknown keys are all named", params: map[string]string{secrets.ParameterPrefix + "b": "1", secrets.ParameterPrefix + "a": "2"},
			errHas: []string{"csi.storage.k8s.io/a, csi.storage.k8s.io/b"}},
		{name: "extra metadata keys in the class are unknown keys", params: map[string]string{ParamPVCName: "x"},
			errHas: []string{ParamPVCName}},
		{name: "extra metadata", params: map[string]string{"type": "ssd", ParamFSType: "xfs"}, extra: true,
			want:   map[string]string{"type": "ssd", ParamPVCName: "data-web-0", ParamPVCNamespace: "team-a", ParamPVName: purePV},
			wantFS: "xfs"},
		{name: "extra metadata needs the claim", params: nil, extra: true, noClaim: true,
			errHas: []string{"claim"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			before := maps.Clone(c.params)
			claim := pureClaim()
			if c.noClaim {
				claim = nil
			}
			got, fs, err := CreateParameters(c.params, c.extra, purePV, claim, "")
			if !maps.Equal(before, c.params) {
				t.Errorf("input modified: %v, was %v", c.params, before)
			}
			if c.errHas != nil {
				if err == nil {
					t.Fatalf("no error; got %v %q", got, fs)
				}
				if !errors.Is(err, ErrInvalidParameters) {
					t.Errorf("error does not wrap ErrInvalidParameters: %v", err)
				}
				for _, s := range c.errHas {
					if !strings.Contains(err.Error(), s) {
						t.Errorf("error %q does not contain %q", err, s)
					}
				}
				for _, s := range c.errAbsent {
					if strings.Contains(err.Error(), s) {
						t.Errorf("error %q contains the value %q", err, s)
					}
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got == nil || !maps.Equal(got, c.want) {
				t.Errorf("driver parameters %v, want %v", got, c.want)
			}
			if fs != c.wantFS {
				t.Errorf("fstype %q, want %q", fs, c.wantFS)
			}
		})
	}
}

func pureClaimWith(modes []corev1.PersistentVolumeAccessMode, volumeMode *corev1.PersistentVolumeMode) *corev1.PersistentVolumeClaim {
	c := pureClaim()
	c.Spec.AccessModes = modes
	c.Spec.VolumeMode = volumeMode
	return c
}

func pureRenderCaps(caps []*csi.VolumeCapability) string {
	var out []string
	for _, c := range caps {
		s := c.GetAccessMode().GetMode().String()
		switch {
		case c.GetBlock() != nil:
			s += "/block"
		case c.GetMount() != nil:
			s += fmt.Sprintf("/mount(%s %v)", c.GetMount().GetFsType(), c.GetMount().GetMountFlags())
		}
		out = append(out, s)
	}
	return strings.Join(out, " ")
}

func TestVolumeCapabilities(t *testing.T) {
	block, fsMode, bogus := corev1.PersistentVolumeBlock, corev1.PersistentVolumeFilesystem, corev1.PersistentVolumeMode("Tape")
	modes := func(m ...corev1.PersistentVolumeAccessMode) []corev1.PersistentVolumeAccessMode { return m }
	const opts = "[noatime]"
	cases := []struct {
		name   string
		claim  *corev1.PersistentVolumeClaim
		snmw   bool
		want   string
		errHas string
	}{
		{name: "RWO", claim: pureClaimWith(modes(corev1.ReadWriteOnce), nil),
			want: "SINGLE_NODE_WRITER/mount(ext4 " + opts + ")"},
		{name: "RWO, driver has SINGLE_NODE_MULTI_WRITER", claim: pureClaimWith(modes(corev1.ReadWriteOnce), nil), snmw: true,
			want: "SINGLE_NODE_MULTI_WRITER/mount(ext4 " + opts + ")"},
		{name: "RWOP", claim: pureClaimWith(modes(corev1.ReadWriteOncePod), nil),
			want: "SINGLE_NODE_WRITER/mount(ext4 " + opts + ")"},
		{name: "RWOP, driver has SINGLE_NODE_MULTI_WRITER", claim: pureClaimWith(modes(corev1.ReadWriteOncePod), nil), snmw: true,
			want: "SINGLE_NODE_SINGLE_WRITER/mount(ext4 " + opts + ")"},
		{name: "ROX", claim: pureClaimWith(modes(corev1.ReadOnlyMany), &fsMode),
			want: "MULTI_NODE_READER_ONLY/mount(ext4 " + opts + ")"},
		{name: "ROX, driver has SINGLE_NODE_MULTI_WRITER", claim: pureClaimWith(modes(corev1.ReadOnlyMany), &fsMode), snmw: true,
			want: "MULTI_NODE_READER_ONLY/mount(ext4 " + opts + ")"},
		{name: "RWX", claim: pureClaimWith(modes(corev1.ReadWriteMany), nil),
			want: "MULTI_NODE_MULTI_WRITER/mount(ext4 " + opts + ")"},
		{name: "RWX, driver has SINGLE_NODE_MULTI_WRITER", claim: pureClaimWith(modes(corev1.ReadWriteMany), nil), snmw: true,
			want: "MULTI_NODE_MULTI_WRITER/mount(ext4 " + opts + ")"},
		{name: "one capability per access mode", claim: pureClaimWith(modes(corev1.ReadWriteOnce, corev1.ReadOnlyMany), nil),
			want: "SINGLE_NODE_WRITER/mount(ext4 " + opts + ") MULTI_NODE_READER_ONLY/mount(ext4 " + opts + ")"},
		{name: "block: no fstype, no mount options", claim: pureClaimWith(modes(corev1.ReadWriteOnce, corev1.ReadWriteMany), &block),
			want: "SINGLE_NODE_WRITER/block MULTI_NODE_MULTI_WRITER/block"},
		{name: "unsupported access mode", claim: pureClaimWith(modes(corev1.ReadWriteOnce, "ReadSometimes"), nil),
			errHas: `unsupported access mode "ReadSometimes"`},
		{name: "no access modes", claim: pureClaimWith(nil, nil), errHas: "no access modes"},
		{name: "unsupported volume mode", claim: pureClaimWith(modes(corev1.ReadWriteOnce), &bogus), errHas: `unsupported volume mode "Tape"`},
		{name: "no claim", claim: nil, errHas: "no claim"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			mountOptions := []string{"noatime"}
			caps, err := VolumeCapabilities(c.claim, "ext4", mountOptions, c.snmw)
			if c.errHas != "" {
				if err == nil || !strings.Contains(err.Error(), c.errHas) || !errors.Is(err, ErrInvalidParameters) {
					t.Fatalf("error %v, want one containing %q wrapping ErrInvalidParameters", err, c.errHas)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := pureRenderCaps(caps); got != c.want {
				t.Errorf("got  %s\nwant %s", got, c.want)
			}
			mountOptions[0] = "changed"
			if got := pureRenderCaps(caps); got != c.want {
				t.Errorf("capabilities share the caller's mount options slice: %s", got)
			}
		})
	}
}

func TestVolumeName(t *testing.T) {
	const uid = "3f2a9b1c-0d4e-4f5a-8b6c-7d8e9f0a1b2c"
	cases := []struct {
		prefix string
		length int
		want   string
	}{
		{"pvc", -1, "pvc-" + uid},
		{"pvc", 0, "pvc-" + uid},
		{"pvc", 8, "pvc-3f2a9b1c"},
		{"vol", 10, "vol-3f2a9b1c0d"},
		{"pvc", 31, "pvc-3f2a9b1c0d4e4f5a8b6c7d8e9f0a1b2"},
		{"pvc", 32, "pvc-3f2a9b1c0d4e4f5a8b6c7d8e9f0a1b2c"},
		{"pvc", 36, "pvc-3f2a9b1c0d4e4f5a8b6c7d8e9f0a1b2c"},
		{"pvc", 100, "pvc-3f2a9b1c0d4e4f5a8b6c7d8e9f0a1b2c"},
	}
	for _, c := range cases {
		if got := VolumeName(c.prefix, uid, c.length); got != c.want {
			t.Errorf("VolumeName(%q, uid, %d) = %q, want %q", c.prefix, c.length, got, c.want)
		}
	}
}

func TestCapacityRange(t *testing.T) {
	withRequest := func(q string) *corev1.PersistentVolumeClaim {
		c := pureClaim()
		c.Spec.Resources.Requests = corev1.ResourceList{corev1.ResourceStorage: resource.MustParse(q)}
		return c
	}
	cases := []struct {
		name   string
		claim  *corev1.PersistentVolumeClaim
		want   int64
		errHas string
	}{
		{"1Gi", withRequest("1Gi"), 1 << 30, ""},
		{"decimal units", withRequest("5G"), 5_000_000_000, ""},
		{"fraction rounds up to a whole byte", withRequest("1500m"), 2, ""},
		{"tiny request rounds up to one byte", withRequest("1m"), 1, ""},
		{"zero", withRequest("0"), 0, "must be positive"},
		{"negative", withRequest("-1Gi"), 0, "must be positive"},
		{"the largest size CSI carries", withRequest("9223372036854775807"), 9223372036854775807, ""},
		{"one byte more than CSI carries", withRequest("9223372036854775808"), 0, "more than CSI can express"},
		{"exabytes beyond int64", withRequest("10E"), 0, "a size of 10E is more than CSI can express"},
		{"no storage request", &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: "c", Namespace: "n"}}, 0, "n/c requests no storage"},
		{"no claim", nil, 0, "no claim"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, err := CapacityRange(c.claim)
			if c.errHas != "" {
				if err == nil || !strings.Contains(err.Error(), c.errHas) || !errors.Is(err, ErrInvalidParameters) {
					t.Fatalf("error %v, want one containing %q wrapping ErrInvalidParameters", err, c.errHas)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got.GetRequiredBytes() != c.want || got.GetLimitBytes() != 0 {
				t.Errorf("got %v, want required %d and no limit", got, c.want)
			}
		})
	}
}

func TestClassifyCreateError(t *testing.T) {
	// [without selected node, with selected node], as external-provisioner's
	// checkError with mayReschedule false and true.
	want := map[codes.Code][2]CreateErrorClass{
		codes.OK:                 {CreateFinal, CreateFinal},
		codes.Canceled:           {CreateInProgress, CreateInProgress},
		codes.Unknown:            {CreateFinal, CreateFinal},
		codes.InvalidArgument:    {CreateFinal, CreateFinal},
		codes.DeadlineExceeded:   {CreateInProgress, CreateInProgress},
		codes.NotFound:           {CreateFinal, CreateFinal},
		codes.AlreadyExists:      {CreateFinal, CreateFinal},
		codes.PermissionDenied:   {CreateFinal, CreateFinal},
		codes.ResourceExhausted:  {CreateFinal, CreateReschedule},
		codes.FailedPrecondition: {CreateFinal, CreateFinal},
		codes.Aborted:            {CreateInProgress, CreateInProgress},
		codes.OutOfRange:         {CreateFinal, CreateFinal},
		codes.Unimplemented:      {CreateFinal, CreateFinal},
		codes.Internal:           {CreateFinal, CreateFinal},
		codes.Unavailable:        {CreateInProgress, CreateInProgress},
		codes.DataLoss:           {CreateFinal, CreateFinal},
		codes.Unauthenticated:    {CreateFinal, CreateFinal},
	}
	if len(want) != 17 {
		t.Fatalf("table has %d codes, want all 17", len(want))
	}
	codesInOrder := slices.Sorted(maps.Keys(want))
	for _, code := range codesInOrder {
		for i, selected := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/selected-node=%v", code, selected), func(t *testing.T) {
				err := status.Error(code, "driver says so") // nil for OK
				if got := ClassifyCreateError(err, selected); got != want[code][i] {
					t.Errorf("got %s, want %s", got, want[code][i])
				}
				if code == codes.OK {
					return
				}
				wrapped := fmt.Errorf("CreateVolume pvc-1: %w", err)
				if got := ClassifyCreateError(wrapped, selected); got != want[code][i] {
					t.Errorf("wrapped: got %s, want %s", got, want[code][i])
				}
			})
		}
	}

	// Errors that are not gRPC statuses: the call may or may not have reached
	// the driver, so the volume may be in the making.
	others := []struct {
		name string
		err  error
	}{
		{"context canceled", context.Canceled},
		{"context deadline", context.DeadlineExceeded},
		{"wrapped context deadline", fmt.Errorf("call: %w", context.DeadlineExceeded)},
		{"plain error", errors.New("connection reset")},
		// A call retried after an Unavailable attempt, whatever its last
		// code: that attempt may have made the volume.
		{"final code after an Unavailable attempt", retriedAfterUnavailable{status.Error(codes.InvalidArgument, "bad")}},
		{"no room after an Unavailable attempt", fmt.Errorf("CreateVolume: %w", retriedAfterUnavailable{status.Error(codes.ResourceExhausted, "full")})},
	}
	for _, o := range others {
		for _, selected := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/selected-node=%v", o.name, selected), func(t *testing.T) {
				if got := ClassifyCreateError(o.err, selected); got != CreateInProgress {
					t.Errorf("got %s, want %s", got, CreateInProgress)
				}
			})
		}
	}
}

func TestCreateErrorClassString(t *testing.T) {
	for c, want := range map[CreateErrorClass]string{
		CreateFinal: "Final", CreateInProgress: "InProgress", CreateReschedule: "Reschedule", CreateErrorClass(9): "CreateErrorClass(9)",
	} {
		if got := c.String(); got != want {
			t.Errorf("%d: %q, want %q", int(c), got, want)
		}
	}
}

// The default filesystem applies only where the class names none.
func TestCreateParametersDefaultFSType(t *testing.T) {
	for _, c := range []struct {
		params map[string]string
		want   string
	}{
		{nil, "ext4"},
		{map[string]string{ParamFSType: "xfs"}, "xfs"},
		{map[string]string{"fsType": "btrfs"}, "btrfs"},
	} {
		_, fs, err := CreateParameters(c.params, false, purePV, pureClaim(), "ext4")
		if err != nil || fs != c.want {
			t.Errorf("parameters %v, default ext4: fstype %q, %v; want %q", c.params, fs, err, c.want)
		}
	}
}

// retriedAfterUnavailable stands for the broker's error of a call it
// retried after an Unavailable attempt (broker.EarlierAttemptUnavailable).
type retriedAfterUnavailable struct{ error }

func (e retriedAfterUnavailable) Unwrap() error                   { return e.error }
func (e retriedAfterUnavailable) EarlierAttemptUnavailable() bool { return true }

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
