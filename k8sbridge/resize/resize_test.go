package resize

import (
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/csibroker/csibroker/k8sbridge/internal/kube"
	"github.com/csibroker/csibroker/k8sbridge/internal/kubetest"
)

func TestResizeTarget(t *testing.T) {
	q := resource.MustParse
	ptr := func(s string) *resource.Quantity { v := q(s); return &v }
	const (
		ctrlInProgress = corev1.PersistentVolumeClaimControllerResizeInProgress
		ctrlInfeasible = corev1.PersistentVolumeClaimControllerResizeInfeasible
		nodePending    = corev1.PersistentVolumeClaimNodeResizePending
		nodeInProgress = corev1.PersistentVolumeClaimNodeResizeInProgress
		nodeInfeasible = corev1.PersistentVolumeClaimNodeResizeInfeasible
	)
	cases := []struct {
		name string
		in   expansionInput
		want string // "" = nothing to do
	}{
		{"first expansion", expansionInput{Request: q("2Gi"), PVCapacity: q("1Gi")}, "2Gi"},
		{"expanded before, larger again", expansionInput{Request: q("3Gi"), PVCapacity: q("2Gi"), Allocated: ptr("2Gi")}, "3Gi"},
		{"uncertain controller error: finish the started size", expansionInput{Request: q("3Gi"), PVCapacity: q("1Gi"), Allocated: ptr("5Gi"), ResizeStatus: ctrlInProgress}, "5Gi"},
		{"final controller error: take the new request", expansionInput{Request: q("3Gi"), PVCapacity: q("1Gi"), Allocated: ptr("5Gi"), ResizeStatus: ctrlInProgress, LastErrorFinal: true}, "3Gi"},
		{"infeasible: take the lowered request", expansionInput{Request: q("3Gi"), PVCapacity: q("1Gi"), Allocated: ptr("5Gi"), ResizeStatus: ctrlInfeasible}, "3Gi"},
		{"infeasible, same request: retry it", expansionInput{Request: q("5Gi"), PVCapacity: q("1Gi"), Allocated: ptr("5Gi"), ResizeStatus: ctrlInfeasible}, "5Gi"},
		{"node pending, PV already there: wait for the kubelet", expansionInput{Request: q("3Gi"), PVCapacity: q("2Gi"), Allocated: ptr("2Gi"), ResizeStatus: nodePending}, ""},
		{"node pending at the request: wait", expansionInput{Request: q("2Gi"), PVCapacity: q("2Gi"), Allocated: ptr("2Gi"), ResizeStatus: nodePending}, ""},
		{"node in progress at the request: wait", expansionInput{Request: q("2Gi"), PVCapacity: q("2Gi"), Allocated: ptr("2Gi"), ResizeStatus: nodeInProgress}, ""},
		{"node pending, PV below allocated: expand to allocated", expansionInput{Request: q("3Gi"), PVCapacity: q("1Gi"), Allocated: ptr("2Gi"), ResizeStatus: nodePending}, "2Gi"},
		{"node infeasible, PV small: allocated", expansionInput{Request: q("3Gi"), PVCapacity: q("1Gi"), Allocated: ptr("2Gi"), ResizeStatus: nodeInfeasible}, "2Gi"},
		{"node infeasible, PV done, controller driver: allocated", expansionInput{Request: q("2Gi"), PVCapacity: q("2Gi"), Allocated: ptr("2Gi"), ResizeStatus: nodeInfeasible, ControllerExpansion: true}, "2Gi"},
		{"node infeasible, PV done, node-only driver: request", expansionInput{Request: q("2Gi"), PVCapacity: q("3Gi"), Allocated: ptr("3Gi"), ResizeStatus: nodeInfeasible}, "2Gi"},
		{"PV expanded, claim not updated: finish recording", expansionInput{Request: q("2Gi"), PVCapacity: q("2Gi"), Allocated: ptr("2Gi"), ResizeStatus: ctrlInProgress}, "2Gi"},
		{"user shrank request below done PV while in progress", expansionInput{Request: q("2Gi"), PVCapacity: q("3Gi"), Allocated: ptr("3Gi"), ResizeStatus: ctrlInfeasible}, "3Gi"},
		{"no status but allocated: resume it", expansionInput{Request: q("2Gi"), PVCapacity: q("2Gi"), Allocated: ptr("2Gi")}, "2Gi"},
		{"old-style claim waiting for the node", expansionInput{Request: q("2Gi"), PVCapacity: q("2Gi"), FSResizePending: true}, ""},
		{"statically larger PV", expansionInput{Request: q("2Gi"), PVCapacity: q("5Gi")}, "2Gi"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, ok := expansionTarget(tc.in)
			switch {
			case tc.want == "" && ok:
				t.Fatalf("target %s, want nothing to do", got.String())
			case tc.want != "" && !ok:
				t.Fatalf("nothing to do, want %s", tc.want)
			case tc.want != "" && got.Cmp(q(tc.want)) != 0:
				t.Fatalf("target %s, want %s", got.String(), tc.want)
			}
		})
	}
}

func TestResizeVolumeCapability(t *testing.T) {
	block, fs := corev1.PersistentVolumeBlock, corev1.PersistentVolumeFilesystem
	src := &corev1.CSIPersistentVolumeSource{Driver: "d", VolumeHandle: "v", FSType: "xfs"}
	modes := func(m ...corev1.PersistentVolumeAccessMode) []corev1.PersistentVolumeAccessMode { return m }
	cases := []struct {
		name  string
		spec  corev1.PersistentVolumeSpec
		snmw  bool
		mode  csi.VolumeCapability_AccessMode_Mode
		block bool
		err   string
	}{
		{"RWO mount with options", corev1.PersistentVolumeSpec{AccessModes: modes(corev1.ReadWriteOnce), VolumeMode: &fs, MountOptions: []string{"noatime"}}, false, csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER, false, ""},
		{"RWO, driver with SINGLE_NODE_MULTI_WRITER", corev1.PersistentVolumeSpec{AccessModes: modes(corev1.ReadWriteOnce)}, true, csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER, false, ""},
		{"RWOP", corev1.PersistentVolumeSpec{AccessModes: modes(corev1.ReadWriteOncePod)}, false, csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER, false, ""},
		{"RWOP, driver with SINGLE_NODE_MULTI_WRITER", corev1.PersistentVolumeSpec{AccessModes: modes(corev1.ReadWriteOncePod)}, true, csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER, false, ""},
		{"RWX wins", corev1.PersistentVolumeSpec{AccessModes: modes(corev1.ReadOnlyMany, corev1.ReadWriteMany)}, false, csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER, false, ""},
		{"ROX block", corev1.PersistentVolumeSpec{AccessModes: modes(corev1.ReadOnlyMany), VolumeMode: &block}, false, csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY, true, ""},
		{"ROX with RWO has no CSI mode", corev1.PersistentVolumeSpec{AccessModes: modes(corev1.ReadOnlyMany, corev1.ReadWriteOnce)}, false, 0, false, "ReadOnlyMany and ReadWriteOnce"},
		{"no access mode", corev1.PersistentVolumeSpec{}, false, 0, false, "unsupported AccessMode"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			tc.spec.CSI = src
			c, err := resizeVolumeCapability(tc.spec, tc.snmw)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("err %v, want %q", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if c.GetAccessMode().GetMode() != tc.mode {
				t.Errorf("mode %s, want %s", c.GetAccessMode().GetMode(), tc.mode)
			}
			if tc.block != (c.GetBlock() != nil) {
				t.Errorf("access type %v", c.GetAccessType())
			}
			if !tc.block && (c.GetMount().GetFsType() != "xfs" || strings.Join(c.GetMount().GetMountFlags(), ",") != strings.Join(tc.spec.MountOptions, ",")) {
				t.Errorf("mount %v", c.GetMount())
			}
		})
	}
	if _, err := resizeVolumeCapability(corev1.PersistentVolumeSpec{AccessModes: modes(corev1.ReadWriteOnce)}, false); err == nil {
		t.Error("a PV without a CSI source must be refused")
	}
}

func TestResizeErrorClasses(t *testing.T) {
	cases := []struct {
		code              codes.Code
		final, infeasible bool
	}{
		{codes.InvalidArgument, true, true},
		{codes.OutOfRange, true, true},
		{codes.NotFound, true, true},
		{codes.FailedPrecondition, true, false}, // in use: offline-only driver
		{codes.Internal, true, false},
		{codes.Unimplemented, true, false},
		{codes.PermissionDenied, true, false},
		{codes.Unavailable, false, false},
		{codes.DeadlineExceeded, false, false},
		{codes.Canceled, false, false},
		{codes.ResourceExhausted, false, false},
		{codes.Aborted, false, false},
	}
	for _, tc := range cases {
		if got := resizeFinalError(tc.code); got != tc.final {
			t.Errorf("%s: final %v, want %v", tc.code, got, tc.final)
		}
		if got := resizeInfeasible(tc.code); got != tc.infeasible {
			t.Errorf("%s: infeasible %v, want %v", tc.code, got, tc.infeasible)
		}
	}
}

// TestResizeStatusSteps walks a claim through the status steps and checks
// what each writes, and that repeating a step writes nothing.
func TestResizeStatusSteps(t *testing.T) {
	q := resource.MustParse
	old := metav1.NewTime(time.Now().Add(-time.Hour).Truncate(time.Second))
	claim := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: "c", Namespace: "ns", ResourceVersion: "7", Annotations: map[string]string{kube.AnnNodeExpansionNotRequired: "true"}},
		Spec:       corev1.PersistentVolumeClaimSpec{VolumeName: "pv", Resources: corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: q("2Gi")}}},
		Status: corev1.PersistentVolumeClaimStatus{Phase: corev1.ClaimBound, Capacity: corev1.ResourceList{corev1.ResourceStorage: q("1Gi")},
			Conditions: []corev1.PersistentVolumeClaimCondition{{Type: corev1.PersistentVolumeClaimVolumeModifyingVolume, Status: corev1.ConditionTrue, LastTransitionTime: old}}},
	}
	statusOf := func(c *corev1.PersistentVolumeClaim) corev1.ClaimResourceStatus {
		return c.Status.AllocatedResourceStatuses[corev1.ResourceStorage]
	}
	condTypes := func(c *corev1.PersistentVolumeClaim) string {
		var s []string
		for _, x := range c.Status.Conditions {
			s = append(s, string(x.Type))
		}
		return strings.Join(s, ",")
	}
	noop := func(step string, from, to *corev1.PersistentVolumeClaim) {
		t.Helper()
		if p, err := kube.ClaimStatusPatch(from, to, true); err != nil || p != nil {
			t.Errorf("%s again: patch %s (%v), want none", step, p, err)
		}
	}

	s1 := resizeInProgress(claim, q("2Gi"))
	if statusOf(s1) != corev1.PersistentVolumeClaimControllerResizeInProgress || condTypes(s1) != "ModifyingVolume,Resizing" || s1.Annotations[kube.AnnNodeExpansionNotRequired] != "" {
		t.Fatalf("in progress: %s %s %v", statusOf(s1), condTypes(s1), s1.Annotations)
	}
	if a := s1.Status.AllocatedResources[corev1.ResourceStorage]; a.Cmp(q("2Gi")) != 0 {
		t.Fatalf("allocated %s", a.String())
	}
	if len(claim.Status.Conditions) != 1 || claim.Status.AllocatedResources != nil {
		t.Fatal("a step modified its input")
	}
	p, err := kube.ClaimStatusPatch(claim, s1, true)
	if err != nil || !strings.Contains(string(p), `"resourceVersion":"7"`) || !strings.Contains(string(p), `"allocatedResources"`) || strings.Contains(string(p), `"spec"`) {
		t.Fatalf("patch %s (%v): want status changes with a resourceVersion precondition", p, err)
	}
	noop("in progress", s1, resizeInProgress(s1, q("2Gi")))

	s2 := resizeControllerFailed(s1, codes.InvalidArgument, "failed to expand pvc with rpc error: code = InvalidArgument desc = no", true)
	if statusOf(s2) != corev1.PersistentVolumeClaimControllerResizeInfeasible || condTypes(s2) != "ModifyingVolume,Resizing,ControllerResizeError" {
		t.Fatalf("infeasible: %s %s", statusOf(s2), condTypes(s2))
	}
	if p, err := kube.ClaimStatusPatch(s1, s2, false); err != nil || strings.Contains(string(p), "resourceVersion") {
		t.Errorf("failure patch %s (%v): must not need the latest resourceVersion", p, err)
	}
	noop("infeasible", s2, resizeControllerFailed(s2, codes.InvalidArgument, "failed to expand pvc with rpc error: code = InvalidArgument desc = other", true))
	// Retrying the same size keeps the recorded failure.
	noop("retry of the same size", s2, resizeInProgress(s2, q("2Gi")))

	s3 := resizeInProgress(s2, q("1536Mi"))
	if statusOf(s3) != corev1.PersistentVolumeClaimControllerResizeInProgress || condTypes(s3) != "ModifyingVolume,Resizing" {
		t.Fatalf("lowered request: %s %s", statusOf(s3), condTypes(s3))
	}
	if got := kubetest.ClaimCondition(s3, corev1.PersistentVolumeClaimResizing).LastTransitionTime; !got.Equal(&kubetest.ClaimCondition(s1, corev1.PersistentVolumeClaimResizing).LastTransitionTime) {
		t.Errorf("Resizing condition restarted: %v", got)
	}

	s4 := resizeNodePending(resizeControllerFailed(s3, codes.Internal, "failed to expand pvc with rpc error: code = Internal desc = x", false))
	if statusOf(s4) != corev1.PersistentVolumeClaimNodeResizePending || condTypes(s4) != "ModifyingVolume,Resizing,FileSystemResizePending" {
		t.Fatalf("node pending: %s %s", statusOf(s4), condTypes(s4))
	}
	if m := kubetest.ClaimCondition(s4, corev1.PersistentVolumeClaimFileSystemResizePending).Message; m != fsResizePendingMessage {
		t.Errorf("message %q", m)
	}
	noop("node pending", s4, resizeNodePending(s4))

	s5 := resizeFinished(s3, q("1536Mi"))
	if statusOf(s5) != "" || s5.Status.AllocatedResourceStatuses != nil || condTypes(s5) != "ModifyingVolume" || s5.Annotations[kube.AnnNodeExpansionNotRequired] != "true" {
		t.Fatalf("finished: %v %s %v", s5.Status.AllocatedResourceStatuses, condTypes(s5), s5.Annotations)
	}
	if c := s5.Status.Capacity[corev1.ResourceStorage]; c.Cmp(q("1536Mi")) != 0 {
		t.Fatalf("capacity %s", c.String())
	}
	if !claimNeedsResize(s5) { // request 2Gi > 1536Mi
		t.Error("claim asking for more than it got must still need a resize")
	}
}

// TestResizeTriggered: which claim updates bring a claim to the resizer. A
// request raised while the kubelet finished the previous expansion is seen
// when the kubelet writes the new capacity, not at the next resync.
func TestResizeTriggered(t *testing.T) {
	claim := func(rv, request, capacity string, mod func(*corev1.PersistentVolumeClaim)) *corev1.PersistentVolumeClaim {
		c := &corev1.PersistentVolumeClaim{
			ObjectMeta: metav1.ObjectMeta{Name: "c", Namespace: "ns", ResourceVersion: rv},
			Spec: corev1.PersistentVolumeClaimSpec{VolumeName: "pv",
				Resources: corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse(request)}}},
			Status: corev1.PersistentVolumeClaimStatus{Phase: corev1.ClaimBound, Capacity: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse(capacity)}},
		}
		if mod != nil {
			mod(c)
		}
		return c
	}
	pending := func(c *corev1.PersistentVolumeClaim) {
		c.Status.AllocatedResourceStatuses = map[corev1.ResourceName]corev1.ClaimResourceStatus{corev1.ResourceStorage: corev1.PersistentVolumeClaimNodeResizePending}
	}
	for _, tc := range []struct {
		name     string
		old, cur *corev1.PersistentVolumeClaim
		want     bool
	}{
		{"request raised", claim("1", "10Gi", "10Gi", nil), claim("2", "15Gi", "10Gi", nil), true},
		{"resync", claim("1", "15Gi", "10Gi", nil), claim("1", "15Gi", "10Gi", nil), true},
		{"the kubelet finished with a larger request waiting", claim("1", "20Gi", "10Gi", pending), claim("2", "20Gi", "15Gi", nil), true},
		{"the resizer's own status write", claim("1", "20Gi", "10Gi", nil), claim("2", "20Gi", "10Gi", pending), false},
		{"a label changed", claim("1", "20Gi", "10Gi", nil), claim("2", "20Gi", "10Gi", func(c *corev1.PersistentVolumeClaim) { c.Labels = map[string]string{"a": "b"} }), false},
		{"the expansion finished, nothing more asked", claim("1", "15Gi", "10Gi", pending), claim("2", "15Gi", "15Gi", nil), false},
	} {
		if got := resizeTriggered(tc.old, tc.cur); got != tc.want {
			t.Errorf("%s: triggered %v, want %v", tc.name, got, tc.want)
		}
	}
}

// TestResizeWarnings: what the bridge remembers of the Events eventOnce
// recorded (the resizer's warnings: a request and a failure), and when it
// records one again: about something else, or the same once eventRepeat
// has passed since it was recorded.
func TestResizeWarnings(t *testing.T) {
	type warning struct{ reason, what string }
	failed := func(request, failure string) warning {
		claim := &corev1.PersistentVolumeClaim{Spec: corev1.PersistentVolumeClaimSpec{Resources: corev1.VolumeResourceRequirements{
			Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse(request)}}}}
		return warning{"VolumeResizeFailed", requestOf(claim) + " " + failure}
	}
	a2 := failed("2Gi", "ControllerExpandVolume FailedPrecondition")
	a2other := failed("2048Mi", "ControllerExpandVolume FailedPrecondition") // the same size, written otherwise
	b2 := failed("2Gi", "ControllerExpandVolume Internal")
	a3 := failed("3Gi", "ControllerExpandVolume FailedPrecondition")
	other := warning{"Other", a2.what}
	var ws kube.EventMemory
	t0 := time.Now()
	steps := []struct {
		name  string
		claim types.UID
		w     warning
		do    func()
		after time.Duration // since t0
		want  bool
	}{
		{name: "first failure", claim: "c1", w: a2, want: true},
		{name: "the same again", claim: "c1", w: a2, want: false},
		{name: "the same size written otherwise", claim: "c1", w: a2other, want: false},
		{name: "another claim", claim: "c2", w: a2, want: true},
		{name: "another failure", claim: "c1", w: b2, want: true},
		{name: "the first failure back", claim: "c1", w: a2, want: true},
		{name: "another reason", claim: "c1", w: other, want: true},
		{name: "a new request", claim: "c1", w: a3, want: true},
		{name: "the new request again", claim: "c1", w: a3, want: false},
		{name: "after a success", claim: "c1", w: a3, do: func() { ws.Forget("c1") }, want: true},
		{name: "other claims keep theirs", claim: "c2", w: a2, want: false},
		{name: "a new term", claim: "c2", w: a2, do: ws.Reset, want: true},
		{name: "the same, a little before eventRepeat", claim: "c2", w: a2, after: kube.EventRepeat - time.Second, want: false},
		{name: "the same, eventRepeat after it was recorded", claim: "c2", w: a2, after: kube.EventRepeat, want: true},
		{name: "and not again right after", claim: "c2", w: a2, after: kube.EventRepeat + time.Second, want: false},
	}
	for _, s := range steps {
		if s.do != nil {
			s.do()
		}
		if got := ws.First(s.claim, s.w.reason, s.w.what, t0.Add(s.after)); got != s.want {
			t.Errorf("%s: record %v, want %v", s.name, got, s.want)
		}
	}
	ws.Forget("c1")
	ws.Forget("c2")
	if ws.Len() != 0 {
		t.Errorf("%d claims remembered after every claim was forgotten", ws.Len())
	}
}

// TestMergeResizeConditionsTakesTheLatestMessage: a failure with another
// code says the new cause, keeping the condition's transition time; the
// same code again, whatever its message, changes nothing (no write).
func TestMergeResizeConditionsTakesTheLatestMessage(t *testing.T) {
	then := metav1.NewTime(time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC))
	claim := &corev1.PersistentVolumeClaim{Status: corev1.PersistentVolumeClaimStatus{Conditions: []corev1.PersistentVolumeClaimCondition{
		{Type: corev1.PersistentVolumeClaimControllerResizeError, Status: corev1.ConditionTrue, LastTransitionTime: then, Reason: "Internal", Message: "failed to expand pvc with rpc error: code = Internal desc = backend busy"},
		{Type: "Other", Status: corev1.ConditionTrue, Message: "kept"},
	}}}
	got := resizeControllerFailed(claim, codes.OutOfRange, "failed to expand pvc with rpc error: code = OutOfRange desc = max size is 16Ti", true)
	conds := got.Status.Conditions
	if len(conds) != 2 || conds[0].Message != "failed to expand pvc with rpc error: code = OutOfRange desc = max size is 16Ti" || conds[0].Reason != "OutOfRange" ||
		!conds[0].LastTransitionTime.Equal(&then) || conds[1].Message != "kept" {
		t.Fatalf("conditions after a failure with another code: %+v", conds)
	}
	again := resizeControllerFailed(got, codes.OutOfRange, "failed to expand pvc with rpc error: code = OutOfRange desc = max size is 16Ti (request 2)", true)
	if !equality.Semantic.DeepEqual(again.Status.Conditions, conds) {
		t.Fatalf("the same code again changed the conditions: %+v -> %+v", conds, again.Status.Conditions)
	}
}
