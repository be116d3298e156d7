package kube

// The informer transform: what the caches keep of each object.
//
// The broker caches every PersistentVolume and PersistentVolumeClaim of the
// cluster, one of each per volume, so they are most of its memory. Decoding
// gives every object its own copy of every string, map and slice, although
// most of them are equal from one volume to the next: annotation and label
// maps, capacity and request maps ("storage": 1Gi), access modes,
// finalizers, the StorageClass and driver names, the volume mode. The
// transform makes equal values share one copy; it drops nothing but
// managedFields.
//
// Nothing else is dropped, although the cached PVs, claims and
// VolumeAttachments are only ever patched (a patch is computed between the
// cached copy and a changed DeepCopy of it, so a field missing from both
// is not touched on the server; the broker's own CSIStorageCapacity
// objects are written whole, and lose nothing but managedFields): the
// broker reads nearly all fields, including annotations of any key (secret
// templates ${pvc.annotations['<key>']}), and a patch made from a copy
// that lacked a field the change itself touches would be wrong.
// managedFields are safe to drop: nothing reads them, and no patch
// mentions them.
//
// Sharing is safe because nothing writes to a cached object: informer
// objects are read-only (client-go's contract), and every write path of this
// package works on a DeepCopy, which copies shared maps and slices too.
// Shared slices have no spare capacity, so even an append to a cached slice
// would not write into another object's.
//
// The tables that find equal values are small, fixed-size and lossy (each
// slot remembers the two last values that hashed to it), so memory stays
// bounded whatever the cluster holds; a value evicted from a table stays
// shared by the objects that have it. Values unique to one object (names,
// UIDs, resource versions, volume handles) are not looked up at all.

import (
	"encoding/binary"
	"hash/maphash"
	"reflect"
	"slices"
	"sync"
	"time"
	"unsafe"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// StripBulk is the transform of every informer of the broker: it drops
// managedFields from every object and makes equal values of PVs and claims
// share memory. It is idempotent, and on an object it has transformed
// already it normally writes nothing. Tombstones pass unchanged (their
// object went through the transform before).
func StripBulk(obj any) (any, error) { return cacheSharer.transform(obj) }

func (t *sharer) transform(obj any) (any, error) {
	switch o := obj.(type) {
	case *corev1.PersistentVolume:
		t.volume(o)
	case *corev1.PersistentVolumeClaim:
		t.claim(o)
	default:
		dropManagedFields(obj)
	}
	return obj, nil
}

// dropManagedFields drops managedFields, which no controller reads.
func dropManagedFields(obj any) {
	if acc, ok := obj.(metav1.ObjectMetaAccessor); ok {
		if m := acc.GetObjectMeta(); m.GetManagedFields() != nil {
			m.SetManagedFields(nil)
		}
	}
}

// Bounds of the sharing tables.
const (
	// shareStringMax: longer strings are not shared (a long string repeated
	// across objects is rare; last-applied-configuration is unique).
	shareStringMax = 256
	// shareKeyMax bounds the content key of a map, slice or pointer; larger
	// values are left as they are.
	shareKeyMax = 1024
	// shareEntriesMax: maps and slices with more entries are left as they are.
	shareEntriesMax = 16

	stringSets = 1024
	valueSets  = 512
)

// cacheSharer is shared by every informer of the process (the transform is
// a plain function); it holds at most stringSets*2 strings and valueSets*2
// values.
var cacheSharer = newSharer()

// sharer finds one copy of equal strings and of equal small values. Its
// methods lock it for one object at a time.
type sharer struct {
	mu   sync.Mutex
	seed maphash.Seed
	strs [stringSets][2]string
	vals [valueSets][2]sharedValue
	buf  []byte   // content key being built
	keys []string // map keys being sorted
}

// sharedValue is a map, slice or pointer and the key of its content.
type sharedValue struct {
	key string
	val any
}

func newSharer() *sharer { return &sharer{seed: maphash.MakeSeed()} }

// Type tags: the first byte of a content key, so that values of different
// types never share a key.
const (
	tagStringMap    = 'm' // map[string]string
	tagResources    = 'r' // corev1.ResourceList
	tagResizeStatus = 'R' // map[corev1.ResourceName]corev1.ClaimResourceStatus
	tagStrings      = 'l' // []string
	tagAccessModes  = 'a' // []corev1.PersistentVolumeAccessMode
	tagVolumeMode   = 'v' // *corev1.PersistentVolumeMode
	tagStringPtr    = 's' // *string
	tagTime         = 't' // *metav1.Time
	tagSecretRef    = 'S' // *corev1.SecretReference
	tagNodeAffinity = 'n' // *corev1.VolumeNodeAffinity
)

// volume shares the equal values of a PV. Every field is kept.
func (t *sharer) volume(pv *corev1.PersistentVolume) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.meta(&pv.ObjectMeta)
	s := &pv.Spec
	setMap(&s.Capacity, t.resources(s.Capacity))
	setSlice(&s.AccessModes, shareStrings(t, tagAccessModes, s.AccessModes))
	if r := s.ClaimRef; r != nil {
		// Name, UID and resourceVersion are the claim's own.
		shareStr(t, &r.Kind)
		shareStr(t, &r.APIVersion)
		shareStr(t, &r.Namespace)
		shareStr(t, &r.FieldPath)
	}
	shareStr(t, &s.PersistentVolumeReclaimPolicy)
	shareStr(t, &s.StorageClassName)
	setSlice(&s.MountOptions, shareStrings(t, tagStrings, s.MountOptions))
	setPtr(&s.VolumeMode, sharePtr(t, tagVolumeMode, s.VolumeMode))
	setPtr(&s.VolumeAttributesClassName, sharePtr(t, tagStringPtr, s.VolumeAttributesClassName))
	setPtr(&s.NodeAffinity, t.nodeAffinity(s.NodeAffinity))
	if c := s.CSI; c != nil {
		// The volume handle is the volume's own.
		shareStr(t, &c.Driver)
		shareStr(t, &c.FSType)
		setMap(&c.VolumeAttributes, shareMap(t, tagStringMap, c.VolumeAttributes))
		for _, p := range []**corev1.SecretReference{&c.ControllerPublishSecretRef, &c.NodeStageSecretRef,
			&c.NodePublishSecretRef, &c.ControllerExpandSecretRef, &c.NodeExpandSecretRef} {
			setPtr(p, t.secretRef(*p))
		}
	}
	shareStr(t, &pv.Status.Phase)
	shareStr(t, &pv.Status.Reason)
	shareStr(t, &pv.Status.Message)
	setPtr(&pv.Status.LastPhaseTransitionTime, t.time(pv.Status.LastPhaseTransitionTime))
}

// claim shares the equal values of a PVC. Every field is kept.
func (t *sharer) claim(c *corev1.PersistentVolumeClaim) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.meta(&c.ObjectMeta)
	s := &c.Spec
	setSlice(&s.AccessModes, shareStrings(t, tagAccessModes, s.AccessModes))
	if sel := s.Selector; sel != nil {
		setMap(&sel.MatchLabels, shareMap(t, tagStringMap, sel.MatchLabels))
	}
	setMap(&s.Resources.Limits, t.resources(s.Resources.Limits))
	setMap(&s.Resources.Requests, t.resources(s.Resources.Requests))
	setPtr(&s.StorageClassName, sharePtr(t, tagStringPtr, s.StorageClassName))
	setPtr(&s.VolumeMode, sharePtr(t, tagVolumeMode, s.VolumeMode))
	setPtr(&s.VolumeAttributesClassName, sharePtr(t, tagStringPtr, s.VolumeAttributesClassName))
	st := &c.Status
	shareStr(t, &st.Phase)
	setSlice(&st.AccessModes, shareStrings(t, tagAccessModes, st.AccessModes))
	setMap(&st.Capacity, t.resources(st.Capacity))
	setMap(&st.AllocatedResources, t.resources(st.AllocatedResources))
	setMap(&st.AllocatedResourceStatuses, shareMap(t, tagResizeStatus, st.AllocatedResourceStatuses))
	setPtr(&st.CurrentVolumeAttributesClassName, sharePtr(t, tagStringPtr, st.CurrentVolumeAttributesClassName))
	for i := range st.Conditions {
		cd := &st.Conditions[i]
		shareStr(t, &cd.Type)
		shareStr(t, &cd.Status)
		shareStr(t, &cd.Reason)
	}
}

// meta drops managedFields and shares labels, annotations, finalizers and
// the namespace. Name, UID and resourceVersion are the object's own.
func (t *sharer) meta(m *metav1.ObjectMeta) {
	if m.ManagedFields != nil {
		m.ManagedFields = nil
	}
	shareStr(t, &m.Namespace)
	shareStr(t, &m.GenerateName)
	setMap(&m.Labels, shareMap(t, tagStringMap, m.Labels))
	setMap(&m.Annotations, shareMap(t, tagStringMap, m.Annotations))
	setSlice(&m.Finalizers, shareStrings(t, tagStrings, m.Finalizers))
}

// str returns the table's copy of s, remembering s if there is none.
func (t *sharer) str(s string) string {
	if len(s) == 0 || len(s) > shareStringMax {
		return s
	}
	set := &t.strs[maphash.String(t.seed, s)%stringSets]
	if set[0] == s {
		return set[0]
	}
	if set[1] == s {
		set[0], set[1] = set[1], set[0]
		return set[0]
	}
	set[1], set[0] = set[0], s
	return s
}

// lookup returns the value stored under the content key in t.buf.
func (t *sharer) lookup() (any, bool) {
	set := &t.vals[maphash.Bytes(t.seed, t.buf)%valueSets]
	if string(t.buf) == set[0].key {
		return set[0].val, true
	}
	if string(t.buf) == set[1].key {
		set[0], set[1] = set[1], set[0]
		return set[0].val, true
	}
	return nil, false
}

// store remembers v under the content key in t.buf.
func (t *sharer) store(v any) {
	set := &t.vals[maphash.Bytes(t.seed, t.buf)%valueSets]
	set[1], set[0] = set[0], sharedValue{key: string(t.buf), val: v}
}

// keyString appends s to the content key, length first, so that no two
// different contents have the same key.
func (t *sharer) keyString(s string) {
	t.buf = binary.AppendUvarint(t.buf, uint64(len(s)))
	t.buf = append(t.buf, s...)
}

// sortedKeys returns m's keys in order in t.keys; the caller clears t.keys.
func sortedKeys[K ~string, V any](t *sharer, m map[K]V) []string {
	keys := t.keys[:0]
	for k := range m {
		keys = append(keys, string(k))
	}
	slices.Sort(keys)
	t.keys = keys
	return keys
}

// shareMap returns the shared map equal to m, or a copy of m with shared
// keys and values that becomes the shared one.
func shareMap[K, V ~string](t *sharer, tag byte, m map[K]V) map[K]V {
	if len(m) == 0 || len(m) > shareEntriesMax {
		return m
	}
	t.buf = append(t.buf[:0], tag)
	keys := sortedKeys(t, m)
	for _, k := range keys {
		t.keyString(k)
		t.keyString(string(m[K(k)]))
	}
	clear(keys)
	if len(t.buf) > shareKeyMax {
		return m
	}
	if v, ok := t.lookup(); ok {
		if shared, ok := v.(map[K]V); ok {
			return shared
		}
	}
	n := make(map[K]V, len(m))
	for k, v := range m {
		n[K(t.str(string(k)))] = V(t.str(string(v)))
	}
	t.store(n)
	return n
}

// resources returns the shared resource list equal to rl (same names, same
// quantities with the same format and text), or a copy that becomes the
// shared one.
func (t *sharer) resources(rl corev1.ResourceList) corev1.ResourceList {
	if len(rl) == 0 || len(rl) > shareEntriesMax {
		return rl
	}
	t.buf = append(t.buf[:0], tagResources)
	keys := sortedKeys(t, rl)
	for _, k := range keys {
		q := rl[corev1.ResourceName(k)]
		t.keyString(k)
		t.keyString(q.String())
		t.buf = append(t.buf, byte(len(q.Format)))
		t.buf = append(t.buf, q.Format...)
	}
	clear(keys)
	if len(t.buf) > shareKeyMax {
		return rl
	}
	if v, ok := t.lookup(); ok {
		if shared, ok := v.(corev1.ResourceList); ok {
			return shared
		}
	}
	n := make(corev1.ResourceList, len(rl))
	for k, q := range rl {
		n[corev1.ResourceName(t.str(string(k)))] = q
	}
	t.store(n)
	return n
}

// shareStrings returns the shared slice equal to s, or a copy of s with
// shared strings and no spare capacity that becomes the shared one.
func shareStrings[E ~string](t *sharer, tag byte, s []E) []E {
	if len(s) == 0 || len(s) > shareEntriesMax {
		return s
	}
	t.buf = append(t.buf[:0], tag)
	for _, e := range s {
		t.keyString(string(e))
	}
	if len(t.buf) > shareKeyMax {
		return s
	}
	if v, ok := t.lookup(); ok {
		if shared, ok := v.([]E); ok {
			return shared
		}
	}
	n := make([]E, len(s))
	for i, e := range s {
		n[i] = E(t.str(string(e)))
	}
	t.store(n)
	return n
}

// sharePtr returns the shared pointer to a string equal to *p.
func sharePtr[E ~string](t *sharer, tag byte, p *E) *E {
	if p == nil || len(*p) > shareStringMax {
		return p
	}
	t.buf = append(t.buf[:0], tag)
	t.buf = append(t.buf, *p...)
	if v, ok := t.lookup(); ok {
		if shared, ok := v.(*E); ok {
			return shared
		}
	}
	n := new(E)
	*n = E(t.str(string(*p)))
	t.store(n)
	return n
}

// time returns the shared pointer to an equal time. API timestamps have
// whole seconds, so PVs bound in the same second share one.
func (t *sharer) time(p *metav1.Time) *metav1.Time {
	// Only decoded times: local, no monotonic reading (== then means equal).
	if p == nil || p.Location() != time.Local || p.Time != p.Round(0) {
		return p
	}
	t.buf = append(t.buf[:0], tagTime)
	t.buf = binary.AppendVarint(t.buf, p.Unix())
	t.buf = binary.AppendVarint(t.buf, int64(p.Nanosecond()))
	if v, ok := t.lookup(); ok {
		if shared, ok := v.(*metav1.Time); ok {
			return shared
		}
	}
	t.store(p)
	return p
}

// secretRef returns the shared pointer to an equal secret reference.
func (t *sharer) secretRef(p *corev1.SecretReference) *corev1.SecretReference {
	if p == nil {
		return p
	}
	t.buf = append(t.buf[:0], tagSecretRef)
	t.keyString(p.Name)
	t.keyString(p.Namespace)
	if len(t.buf) > shareKeyMax {
		return p
	}
	if v, ok := t.lookup(); ok {
		if shared, ok := v.(*corev1.SecretReference); ok {
			return shared
		}
	}
	n := &corev1.SecretReference{Name: t.str(p.Name), Namespace: t.str(p.Namespace)}
	t.store(n)
	return n
}

// nodeAffinity returns the shared pointer to an equal node affinity (the
// volumes of one zone or one node have the same).
func (t *sharer) nodeAffinity(p *corev1.VolumeNodeAffinity) *corev1.VolumeNodeAffinity {
	if p == nil {
		return p
	}
	t.buf = append(t.buf[:0], tagNodeAffinity)
	if !t.keyNodeSelector(p.Required) || len(t.buf) > shareKeyMax {
		return p
	}
	if v, ok := t.lookup(); ok {
		if shared, ok := v.(*corev1.VolumeNodeAffinity); ok {
			return shared
		}
	}
	t.store(p)
	return p
}

// keyNodeSelector appends the content of a node selector to the key; nil
// and empty differ (they do on the wire). false: too large to share.
func (t *sharer) keyNodeSelector(sel *corev1.NodeSelector) bool {
	if sel == nil {
		t.buf = append(t.buf, 0)
		return true
	}
	t.buf = append(t.buf, 1)
	t.keyLen(sel.NodeSelectorTerms == nil, len(sel.NodeSelectorTerms))
	for _, term := range sel.NodeSelectorTerms {
		for _, reqs := range [][]corev1.NodeSelectorRequirement{term.MatchExpressions, term.MatchFields} {
			t.keyLen(reqs == nil, len(reqs))
			for _, r := range reqs {
				t.keyString(r.Key)
				t.keyString(string(r.Operator))
				t.keyLen(r.Values == nil, len(r.Values))
				for _, v := range r.Values {
					t.keyString(v)
				}
				if len(t.buf) > shareKeyMax {
					return false
				}
			}
		}
	}
	return true
}

// keyLen appends a slice's length to the key, nil apart from empty.
func (t *sharer) keyLen(isNil bool, n int) {
	if isNil {
		t.buf = append(t.buf, 0)
		return
	}
	t.buf = binary.AppendUvarint(append(t.buf, 1), uint64(n))
}

// The setters assign only what changes, so that transforming an object
// twice writes nothing the second time.

func shareStr[S ~string](t *sharer, p *S) {
	if s := t.str(string(*p)); unsafe.StringData(s) != unsafe.StringData(string(*p)) {
		*p = S(s)
	}
}

func setMap[M ~map[K]V, K comparable, V any](p *M, m M) {
	if reflect.ValueOf(*p).UnsafePointer() != reflect.ValueOf(m).UnsafePointer() {
		*p = m
	}
}

func setSlice[S ~[]E, E any](p *S, s S) {
	if unsafe.SliceData(*p) != unsafe.SliceData(s) || len(*p) != len(s) || cap(*p) != cap(s) {
		*p = s
	}
}

func setPtr[T any](p **T, v *T) {
	if *p != v {
		*p = v
	}
}
