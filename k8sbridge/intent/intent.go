package intent

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math"
	"slices"
	"sort"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/csibroker/csibroker/policy"
)

// Intent is one in-flight CreateVolume, recorded on the API server before the
// call so that a volume the driver made is never forgotten: if the broker dies
// or the claim disappears before the PV exists, the next leader re-issues the
// same request (CreateVolume is idempotent by name) to learn the volume's ID
// and deletes it.
type Intent struct {
	// VolumeName is the CSI name of the volume (also the PV name).
	VolumeName string `json:"volumeName"`
	Driver     string `json:"driver"`
	// Claim the volume is for.
	ClaimNamespace string `json:"claimNamespace"`
	ClaimName      string `json:"claimName"`
	ClaimUID       string `json:"claimUID"`
	StorageClass   string `json:"storageClass,omitempty"`
	// Request is the CreateVolumeRequest without secrets, protobuf-encoded,
	// so it can be re-issued exactly.
	Request []byte `json:"request"`
	// EarlierRequests are the differing requests of earlier attempts whose
	// volume may exist (oldest first, at most maxEarlierRequests): a
	// driver that checks a repeated request against the volume it made
	// answers only the request that made it, which may be one of these.
	EarlierRequests [][]byte `json:"earlierRequests,omitempty"`
	// ProvisionerSecret is the resolved provisioner secret reference (never
	// its content), needed to re-issue and delete.
	ProvisionerSecret *corev1.SecretReference `json:"provisionerSecret,omitempty"`
	// Node is the selected node for node-local drivers.
	Node string `json:"node,omitempty"`
	// NamespaceLabels of the claim's namespace, for policy decisions after
	// the namespace is deleted (nil, not empty, when they were unknown).
	NamespaceLabels map[string]string `json:"namespaceLabels"`
	// ClaimLabels and SecretSource are what the provisioner secret was
	// decided on (the claim's own labels, where its reference came from),
	// so that recovery is decided on the same, not on less: a grant whose
	// condition reads them would otherwise refuse recovery, and the volume
	// would leak. Entries written before they were recorded have neither.
	ClaimLabels  map[string]string `json:"claimLabels,omitempty"`
	SecretSource *policy.Source    `json:"secretSource,omitempty"`
	Created      metav1.Time       `json:"created"`
	// Superseded marks the entry of an attempt on a node that was deleted
	// while the volume may have been made there, kept when the claim was
	// provisioned anew elsewhere: if the node comes back under its name,
	// recovery deletes that volume. Its key is Key's, not VolumeName.
	Superseded bool `json:"superseded,omitempty"`
}

// maxEarlierRequests bounds Intent.EarlierRequests.
const maxEarlierRequests = 3

// WithEarlier is next, an attempt's entry for the volume of prev, with
// prev's requests kept (see EarlierRequests) when they differ from next's,
// after the earlier requests next holds already. Over the bound, the
// oldest ones and the newest (prev's own) are kept: the first attempt to
// reach the driver, or the last one, is the likeliest to have made it.
func WithEarlier(next, prev Intent) Intent {
	var out [][]byte
	for _, r := range slices.Concat(next.EarlierRequests, prev.EarlierRequests, [][]byte{prev.Request}) {
		if len(r) == 0 || bytes.Equal(r, next.Request) || slices.ContainsFunc(out, func(o []byte) bool { return bytes.Equal(o, r) }) {
			continue
		}
		out = append(out, r)
	}
	if len(out) > maxEarlierRequests {
		out = append(out[:maxEarlierRequests-1], out[len(out)-1])
	}
	next.EarlierRequests = out
	return next
}

// Requests are the requests recovery may re-issue for the entry's volume:
// the latest first, then the earlier ones.
func (in Intent) Requests() [][]byte {
	return append([][]byte{in.Request}, in.EarlierRequests...)
}

// DriverName is the driver the volume is made by.
func (in Intent) DriverName() string { return in.Driver }

// Key is the entry's key in the record: VolumeName, or for a superseded
// entry VolumeName_Node ('_' appears in neither name, and a ConfigMap key
// may hold it).
func (in Intent) Key() string {
	if !in.Superseded {
		return in.VolumeName
	}
	if k := in.VolumeName + "_" + in.Node; len(k) <= maxIntentKey {
		return k
	}
	// A ConfigMap key holds at most 253 characters: a long node name is
	// named by its hash.
	sum := sha256.Sum256([]byte(in.Node))
	return in.VolumeName + "_" + hex.EncodeToString(sum[:12])
}

// maxIntentKey is the longest key a ConfigMap takes.
const maxIntentKey = 253

// Store keeps the in-flight intents of all drivers in one ConfigMap and
// writes it in batches: every Add waits for a write that holds it, and one
// write carries every Add and Remove queued since the last one. Under load
// that is one API write for many claims instead of one per claim.
//
// When to write is decided by writeDue from the Adds queued and their
// arrival rate (batchPolicy): an Add that arrives alone (fewer than one
// more expected within maxLinger) is written after linger, 5 ms; while
// Adds keep arriving, a write waits for target (20) of them, at most
// maxLinger (200 ms) after the oldest, and no longer than a few mean
// arrival gaps after the newest (so a burst that has ended, e.g. when
// every worker is already waiting, is not held). The same rule is also
// applied to each driver's Adds alone, and the write is due at the
// earliest of these times: a quiet driver's lone claim does not wait for a
// busy driver's batch to fill (it takes the busy driver's queued Adds
// along). A write in flight is never joined: Adds queue behind it and,
// once target of them wait, go in the next write at once.
//
// Removes are never urgent: nothing waits for them, and an entry left in the
// record only makes recovery find the PV (or the deleted volume) and drop
// it. They ride along with the next write of Adds; alone they are written
// once no Add has arrived for removeDelay. They never count against the
// record's budget: a write applies them before it adds anything. Has and
// List leave out entries this store has been asked to remove, so recovery
// in this process never acts on a settled entry still in the record.
type Record[T Entry] struct {
	purpose   string // the ConfigMap's csibroker.io/purpose annotation
	client    kubernetes.Interface
	namespace string
	name      string
	log       *slog.Logger
	// MaxEntries bounds the record (a ConfigMap holds at most 1 MiB).
	maxEntries int
	maxBytes   int
	batch      batchPolicy
	// removeDelay: Removes alone are written once no Add has arrived for
	// this long.
	removeDelay time.Duration
	// wait, when set, takes a token of the objects' client budget before
	// each request; client then does not wait again (see UseBudget).
	wait func(context.Context) error
	// reader, when set, serves List with a budget of its own (see
	// UseReader).
	reader kubernetes.Interface

	mu       sync.Mutex
	cond     chan struct{} // closed and replaced when work is queued
	adds     map[string]*pendingAdd[T]
	removes  map[string]bool
	removing map[string]bool   // removes of the write in flight
	cache    *corev1.ConfigMap // last written or read copy
	// cacheGen counts the changes of cache: a List whose read began
	// before one neither seeds the cache nor compares with it.
	cacheGen uint64
	// lost holds the entries of a record this term knew (s.cache) that a
	// read found replaced by another object of that name (deleted, by an
	// administrator say, and made again): until a write carries them back
	// into the record, each flush merges them in, and Has, Get and List
	// count them (their volumes would leak).
	lost   map[string]string
	writes int64
	loaded bool
	// term counts the ends of leadership terms (failAll): a read begun in
	// one term does not seed the cache of the next, which starts from a
	// fresh read.
	term uint64
	// ended: the term is over (failAll) and the next has not begun
	// (StartTerm). Workers of the ended term may still be finishing: what
	// they ask is refused, so it is not written in a later term, when
	// another leader may have changed the record meanwhile.
	ended bool
	// loadMu makes the first read of a term one read, however many
	// provisioning workers ask for it at once (Lookup).
	loadMu   sync.Mutex
	firstRem time.Time // when the oldest queued Remove arrived
	// all: every queued Add and their arrival rate; arrivals: each
	// driver's; lastArrival: the newest Add of any driver.
	all         arrivals
	arrivals    map[string]*arrivals
	lastArrival time.Time
	// mine, when set (Share), says whether this replica may write the
	// entries of a driver.
	mine func(driver string) bool
}

type pendingAdd[T Entry] struct {
	intent T
	done   chan error
}

// arrivals is one driver's Adds: how many are queued, the oldest and
// newest of them, and an exponentially decayed count over rateWindow for
// their arrival rate.
type arrivals struct {
	pending        int
	oldest, newest time.Time
	count          float64
	last           time.Time
}

// arrive counts an Add at now; maxLinger: a silence longer than any batch
// waits restarts the count (what came before says nothing about this
// Add's company).
func (a *arrivals) arrive(now time.Time, maxLinger time.Duration) {
	if a.pending == 0 {
		a.oldest = now
	}
	a.pending++
	a.newest = now
	switch since := now.Sub(a.last); {
	case since > maxLinger:
		a.count = 0
	case since > 0:
		a.count *= math.Exp(-since.Seconds() / rateWindow.Seconds())
	}
	a.count++
	a.last = now
}

// rate is the Adds' arrival rate, per second.
func (a *arrivals) rate() float64 { return a.count / rateWindow.Seconds() }

// batchPolicy says how long queued Adds wait for company before a write.
type batchPolicy struct {
	// linger: every write waits this long after its oldest Add, so Adds
	// that arrive together share it. A lone Add waits only this.
	linger time.Duration
	// maxLinger bounds the wait of any Add before its write starts.
	maxLinger time.Duration
	// target: a write waits for no more than this many Adds.
	target int
	// gaps: the wait also ends this many mean arrival gaps after the
	// newest Add (Adds have stopped coming, e.g. every worker waits).
	gaps float64
}

// defaultBatch: one write per ~20 claims under load, a lone claim delayed
// 5 ms as before, no claim more than 200 ms before its write starts.
var defaultBatch = batchPolicy{linger: 5 * time.Millisecond, maxLinger: 200 * time.Millisecond, target: 20, gaps: 4}

// rateWindow is the time constant of the Add arrival rate estimate (which
// restarts after a silence longer than maxLinger).
const rateWindow = time.Second

// writeDue is when the queued Adds are to be written: pending of them, the
// oldest and newest queued at oldest and newest, arriving at rate per second.
func (p batchPolicy) writeDue(pending int, oldest, newest time.Time, rate float64) time.Time {
	first := oldest.Add(p.linger)
	if pending >= p.target || rate*p.maxLinger.Seconds() < 1 {
		// Enough for one write, or too few Adds to wait for.
		return first
	}
	due := oldest.Add(p.maxLinger)
	if rate > 0 {
		gap := time.Duration(p.gaps * float64(time.Second) / rate)
		if quiet := newest.Add(gap); quiet.Before(due) {
			due = quiet
		}
	}
	if due.Before(first) {
		return first
	}
	return due
}

// ErrFull means too many volumes are being created at once; the
// caller backs off and tries again.
var ErrFull = errors.New("intent record is full: too many volumes being created at once")

// ErrTooLarge means one intent is larger than the record can hold.
var ErrTooLarge = errors.New("intent too large for the intent record")

// Entry is one in-flight operation a Record holds: stored as JSON under
// its Key, a valid ConfigMap key, with its driver's name under "driver"
// (DriverName), which per-driver leadership (Share) goes by.
type Entry interface {
	Key() string
	DriverName() string
}

// Store is the record of in-flight CreateVolume calls.
type Store = Record[Intent]

// volumesPurpose is the volume record's annotation.
const volumesPurpose = "volumes being created; entries are removed when their PV exists or the volume is deleted"

// NewStore uses ConfigMap namespace/name (created when missing).
func NewStore(client kubernetes.Interface, namespace, name string, log *slog.Logger) *Store {
	return NewRecord[Intent](client, namespace, name, volumesPurpose, log)
}

// NewRecord is a record of entries of type T in ConfigMap namespace/name
// (created when missing, with purpose as its csibroker.io/purpose
// annotation): a sibling of the volume record for another kind of
// in-flight call (snapshots being created), with the same batching,
// fencing and recovery of a replaced record.
func NewRecord[T Entry](client kubernetes.Interface, namespace, name, purpose string, log *slog.Logger) *Record[T] {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Record[T]{
		purpose: purpose,
		client:  client, namespace: namespace, name: name, log: log,
		maxEntries: 1500, maxBytes: 900 << 10, batch: defaultBatch, removeDelay: 2 * time.Second,
		cond: make(chan struct{}), adds: map[string]*pendingAdd[T]{}, removes: map[string]bool{}, arrivals: map[string]*arrivals{},
	}
}

// UseBudget makes the record's requests take their tokens from wait (the
// record's rate limiter) before they are built, and go out through client,
// which must not wait again. A write is then cut when its token is granted,
// not when it starts waiting: a write that waits for its token carries
// every Add that arrives meanwhile instead of leaving it to the next.
func (s *Record[T]) UseBudget(client kubernetes.Interface, wait func(context.Context) error) {
	s.client, s.wait = client, wait
}

// UseReader makes List read the record through client, on that client's
// own budget (the informers' reads), not the budget of the record's
// writes: the recovery loop reads the record at every start and interval,
// and each read would otherwise delay a write by a token. Creating a
// missing record stays a write of the record's budget.
func (s *Record[T]) UseReader(client kubernetes.Interface) {
	s.reader = client
}

// take waits for a token for one request of the record; a token taken in
// advance (*prepaid) is used first.
func (s *Record[T]) take(ctx context.Context, prepaid *bool) error {
	if s.wait == nil {
		return nil
	}
	if prepaid != nil && *prepaid {
		*prepaid = false
		return nil
	}
	if err := s.wait(ctx); err != nil {
		return fmt.Errorf("intent record %s/%s: wait for the client budget: %w", s.namespace, s.name, err)
	}
	return nil
}

// Writes is how many API writes the store made.
func (s *Record[T]) Writes() int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.writes
}

// Add records intent and returns once it is durable on the API server: only
// after an update of the record that holds it has succeeded.
func (s *Record[T]) Add(ctx context.Context, in T) error {
	p := &pendingAdd[T]{intent: in, done: make(chan error, 1)}
	now := time.Now()
	s.mu.Lock()
	if s.ended {
		s.mu.Unlock()
		return errTermEnded
	}
	if s.mine != nil && !s.mine(in.DriverName()) {
		s.mu.Unlock()
		return fmt.Errorf("%w: driver %s is led by another replica", errTermEnded, in.DriverName())
	}
	key := in.Key()
	if old, ok := s.adds[key]; ok {
		old.done <- errors.New("intent superseded by a newer Add of the same volume")
		s.dropAddLocked(key)
	}
	s.all.arrive(now, s.batch.maxLinger)
	s.arrivalsOf(in.DriverName()).arrive(now, s.batch.maxLinger)
	s.lastArrival = now
	s.adds[key] = p
	delete(s.removes, key)
	s.signal()
	s.mu.Unlock()
	select {
	case err := <-p.done:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Remove forgets the intent of key (its Key: the volume name, but for a
// superseded entry); it is written with the next batch of Adds, or
// alone once Adds have stopped for a while.
//
// A Remove after the term's end is dropped: the entry stays, and whoever
// leads next finds it settled (its PV exists, or its volume is gone) and
// drops it. Written in a later term instead, it could delete an entry
// another leader recorded again in between, for a volume that may exist.
func (s *Record[T]) Remove(key string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ended {
		return
	}
	if s.mine != nil {
		if d, ok := s.driverOfLocked(key); ok && !s.mine(d) {
			// Its driver's leader settles it: written from here, the
			// Remove could drop an entry that leader wrote again.
			return
		}
	}
	if p, ok := s.adds[key]; ok {
		s.dropAddLocked(key)
		p.done <- errors.New("intent removed before it was written")
	}
	if len(s.removes) == 0 {
		s.firstRem = time.Now()
		// Wake Run only if it may be idle: with Removes already
		// queued, another one changes nothing about when to write.
		s.signal()
	}
	s.removes[key] = true
}

// Share makes the store one of several replicas' that lead different
// drivers (per-driver leader election) over the one record: mine says
// whether this replica leads a driver. An Add of another's driver fails;
// a Remove of an entry of another's driver is dropped (its leader settles
// it). Call it before Run.
func (s *Record[T]) Share(mine func(driver string) bool) { s.mine = mine }

// Handover is told that this replica starts or stops leading driver
// (Share): the Adds and Removes queued for it are dropped (the Adds fail),
// and the record is read again before its next use, since another replica
// may have written the driver's entries meanwhile.
func (s *Record[T]) Handover(driver string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for k, p := range s.adds {
		if p.intent.DriverName() == driver {
			p.done <- fmt.Errorf("%w: leadership of driver %s changed hands", errTermEnded, driver)
			s.dropAddLocked(k)
		}
	}
	for k := range s.removes {
		if d, ok := s.driverOfLocked(k); ok && d == driver {
			delete(s.removes, k)
		}
	}
	s.loaded = false
}

// driverOfLocked is the driver of the entry of key as the store knows it
// (queued, or in the record last read or written).
func (s *Record[T]) driverOfLocked(key string) (string, bool) {
	if p, ok := s.adds[key]; ok {
		return p.intent.DriverName(), true
	}
	v, ok := "", false
	if s.cache != nil {
		v, ok = s.cache.Data[key]
	}
	if !ok && s.lost != nil {
		v, ok = s.lost[key]
	}
	if !ok {
		return "", false
	}
	var in struct {
		Driver string `json:"driver"`
	}
	if json.Unmarshal([]byte(v), &in) != nil {
		return "", false
	}
	return in.Driver, true
}

// arrivalsOf is driver's arrivals (the caller holds s.mu).
func (s *Record[T]) arrivalsOf(driver string) *arrivals {
	a, ok := s.arrivals[driver]
	if !ok {
		a = &arrivals{}
		s.arrivals[driver] = a
	}
	return a
}

// dropAddLocked takes the queued Add of key out of the queue and its
// driver's count (the caller holds s.mu).
func (s *Record[T]) dropAddLocked(key string) {
	if p, ok := s.adds[key]; ok {
		delete(s.adds, key)
		s.all.pending = len(s.adds)
		if a := s.arrivals[p.intent.DriverName()]; a != nil && a.pending > 0 {
			a.pending--
		}
	}
}

func (s *Record[T]) signal() {
	close(s.cond)
	s.cond = make(chan struct{})
}

// removedLocked reports whether volumeName was removed here and the record
// may still show it (the caller holds s.mu).
func (s *Record[T]) removedLocked(volumeName string) bool {
	return s.removes[volumeName] || s.removing[volumeName]
}

// Has reports whether the last record written or read holds volumeName, or
// an Add for it is queued (no API call); a Remove not yet written counts.
func (s *Record[T]) Has(volumeName string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.adds[volumeName]; ok {
		return true
	}
	if s.removedLocked(volumeName) {
		return false
	}
	if s.cache != nil {
		if _, ok := s.cache.Data[volumeName]; ok {
			return true
		}
	}
	if s.lost != nil {
		_, ok := s.lost[volumeName]
		return ok
	}
	return false
}

// Get returns the entry of volumeName as Has finds it (no API call).
func (s *Record[T]) Get(volumeName string) (T, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if p, ok := s.adds[volumeName]; ok {
		return p.intent, true
	}
	if s.removedLocked(volumeName) {
		var zero T
		return zero, false
	}
	var v string
	var ok bool
	if s.cache != nil {
		v, ok = s.cache.Data[volumeName]
	}
	if !ok && s.lost != nil {
		v, ok = s.lost[volumeName]
	}
	if !ok {
		var zero T
		return zero, false
	}
	var in T
	if err := json.Unmarshal([]byte(v), &in); err != nil {
		var zero T
		return zero, false
	}
	return in, true
}

// Lookup is Get after the record has been read from the API server in this
// term (a List, or a write): at the start of a term the store knows nothing
// of the entries an earlier leader wrote.
func (s *Record[T]) Lookup(ctx context.Context, volumeName string) (T, bool, error) {
	known := func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.loaded && s.cache != nil
	}
	if !known() {
		s.loadMu.Lock()
		if !known() {
			if _, err := s.List(ctx); err != nil {
				s.loadMu.Unlock()
				var zero T
				return zero, false, err
			}
		}
		s.loadMu.Unlock()
	}
	in, ok := s.Get(volumeName)
	return in, ok, nil
}

// List reads the record from the API server (the source of truth at
// start-up and for recovery), without the entries this store has been asked
// to remove and has not written yet.
func (s *Record[T]) List(ctx context.Context) ([]T, error) {
	s.mu.Lock()
	term, gen := s.term, s.cacheGen
	s.mu.Unlock()
	cm, err := s.read(ctx)
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	// A read that began before the cache last changed may predate what
	// the store wrote or read since (even the record's replacement).
	if s.term == term && s.cacheGen == gen {
		if s.noteReplacedLocked(cm) {
			// The write-back is due: a record left without them for
			// long is what a leader change would then start from.
			s.setCacheLocked(cm)
			s.loaded = true
			s.signal()
		} else if !s.loaded {
			// Only the first read seeds the cache: later the cache
			// holds what this store wrote.
			s.setCacheLocked(cm)
			s.loaded = true
		}
	}
	rec := cm
	if s.lost != nil {
		rec = cm.DeepCopy()
		if rec.Data == nil {
			rec.Data = map[string]string{}
		}
		for k, v := range s.lost {
			if _, ok := rec.Data[k]; !ok {
				rec.Data[k] = v
			}
		}
	}
	all := decodeIntents[T](rec, s.log)
	out := all[:0]
	for _, in := range all {
		if !s.removedLocked(in.Key()) {
			out = append(out, in)
		}
	}
	s.mu.Unlock()
	return out, nil
}

func (s *Record[T]) setCacheLocked(cm *corev1.ConfigMap) {
	s.cache = cm
	s.cacheGen++
}

// noteReplacedLocked compares rec, just read from the API server, with the
// record this term last knew (s.cache). If rec is another object (the
// record was deleted and made again), the entries the old one held are
// kept in s.lost, to be written back; it reports whether it was. The
// caller holds s.mu.
func (s *Record[T]) noteReplacedLocked(rec *corev1.ConfigMap) bool {
	old := s.cache
	if old == nil || rec == nil || old.UID == rec.UID {
		return false
	}
	if len(old.Data) > 0 {
		if s.lost == nil {
			s.lost = map[string]string{}
		}
		for k, v := range old.Data {
			if _, ok := s.lost[k]; !ok && !s.removedLocked(k) {
				s.lost[k] = v
			}
		}
		s.log.Error("the intent record was deleted or replaced; the entries it held are written back", "configmap", s.namespace+"/"+s.name, "entries", len(s.lost))
	}
	return true
}

func decodeIntents[T Entry](cm *corev1.ConfigMap, log *slog.Logger) []T {
	var out []T
	for k, v := range cm.Data {
		var in T
		if err := json.Unmarshal([]byte(v), &in); err != nil {
			log.Error("intent record: unreadable entry, keeping it for an admin", "configmap", cm.Namespace+"/"+cm.Name, "key", k, "err", err)
			continue
		}
		out = append(out, in)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Key() < out[j].Key() })
	return out
}

// read is the record as the API server has it, through the reader if one
// is set (a missing record is created as get does).
func (s *Record[T]) read(ctx context.Context) (*corev1.ConfigMap, error) {
	if s.reader == nil {
		return s.get(ctx, nil)
	}
	cm, err := s.reader.CoreV1().ConfigMaps(s.namespace).Get(ctx, s.name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return s.get(ctx, nil)
	}
	if err != nil {
		return nil, fmt.Errorf("intent record %s/%s: %w", s.namespace, s.name, err)
	}
	return cm, nil
}

func (s *Record[T]) get(ctx context.Context, prepaid *bool) (*corev1.ConfigMap, error) {
	if err := s.take(ctx, prepaid); err != nil {
		return nil, err
	}
	cm, err := s.client.CoreV1().ConfigMaps(s.namespace).Get(ctx, s.name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		if err := s.take(ctx, nil); err != nil {
			return nil, err
		}
		cm, err = s.client.CoreV1().ConfigMaps(s.namespace).Create(ctx, &corev1.ConfigMap{
			ObjectMeta: metav1.ObjectMeta{Name: s.name, Namespace: s.namespace, Labels: map[string]string{"app.kubernetes.io/managed-by": "csibroker"},
				Annotations: map[string]string{"csibroker.io/purpose": s.purpose}},
		}, metav1.CreateOptions{})
		if apierrors.IsAlreadyExists(err) {
			if err := s.take(ctx, nil); err != nil {
				return nil, err
			}
			cm, err = s.client.CoreV1().ConfigMaps(s.namespace).Get(ctx, s.name, metav1.GetOptions{})
		}
	}
	if err != nil {
		return nil, fmt.Errorf("intent record %s/%s: %w", s.namespace, s.name, err)
	}
	return cm, nil
}

// errTermEnded is Add's answer after the term's end (failAll).
var errTermEnded = errors.New("intent record: the leadership term has ended")

// StartTerm begins a term: Add and Remove are taken again. The bridge
// calls it before it starts the term's workers; Run calls it too.
func (s *Record[T]) StartTerm() {
	s.mu.Lock()
	s.ended = false
	s.mu.Unlock()
}

// Run writes batches until ctx is done, which ends the term.
func (s *Record[T]) Run(ctx context.Context) {
	s.StartTerm()
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	for {
		s.mu.Lock()
		wait := s.cond
		due, work := s.nextWriteLocked()
		s.mu.Unlock()
		if !work {
			select {
			case <-ctx.Done():
				s.failAll(ctx.Err())
				return
			case <-wait:
			}
			continue
		}
		if d := time.Until(due); d > 0 {
			timer.Reset(d)
			select {
			case <-ctx.Done():
				timer.Stop()
				s.failAll(ctx.Err())
				return
			case <-wait:
				// More work: decide again.
				timer.Stop()
			case <-timer.C:
				// Decide again: the Adds may have been removed meanwhile.
			}
			continue
		}
		if ctx.Err() != nil {
			s.failAll(ctx.Err())
			return
		}
		s.flush(ctx)
	}
}

// nextWriteLocked is when the queued changes are to be written, if any are
// queued (the caller holds s.mu).
func (s *Record[T]) nextWriteLocked() (time.Time, bool) {
	if len(s.adds) > 0 {
		due := s.batch.writeDue(len(s.adds), s.all.oldest, s.all.newest, s.all.rate())
		for _, a := range s.arrivals {
			if a.pending == 0 {
				continue
			}
			if d := s.batch.writeDue(a.pending, a.oldest, a.newest, a.rate()); d.Before(due) {
				due = d
			}
		}
		return due, true
	}
	if len(s.removes) > 0 || s.lost != nil {
		since := s.firstRem
		if s.lastArrival.After(since) {
			since = s.lastArrival
		}
		return since.Add(s.removeDelay), true
	}
	return time.Time{}, false
}

func (s *Record[T]) failAll(err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for k, p := range s.adds {
		p.done <- err
		s.dropAddLocked(k)
	}
	// The term is over: what it meant to remove, and its copy of the
	// record, may be stale by the next term (another leader writes
	// meanwhile), which starts from a fresh read.
	clear(s.removes)
	if len(s.lost) > 0 {
		// Not written back within the term: the next leader starts
		// from a record without them. Said, with the volumes' names,
		// for an administrator to check (a volume may exist without a
		// PV).
		s.log.Error("the term ended before the entries of a deleted intent record were written back", "configmap", s.namespace+"/"+s.name, "volumes", slices.Sorted(maps.Keys(s.lost)))
	}
	s.setCacheLocked(nil)
	s.loaded, s.lost = false, nil
	s.term++
	s.ended = true
}

// flush writes every queued change in one update (re-reading on conflict).
func (s *Record[T]) flush(ctx context.Context) {
	b, ok := s.cutBatch(ctx)
	if !ok {
		return // ctx is done: Run fails what is queued
	}
	var err error
	for attempt := 0; attempt < 5; attempt++ {
		var again bool
		if again, err = s.tryWrite(ctx, b); err == nil || !again {
			break
		}
	}
	if err != nil {
		s.batchFailed(b, err)
	}
}

// batch is what one flush writes: the changes it took from the queue, and
// the record as it was last read.
type batch[T Entry] struct {
	adds    map[string]*pendingAdd[T]
	removes map[string]bool
	prepaid bool              // the first request's token is taken already
	cached  *corev1.ConfigMap // nil: to be read before the write
}

// finish answers every Add of the batch still waiting.
func (b *batch[T]) finish(err error) {
	for _, p := range b.adds {
		p.done <- err
	}
}

// cutBatch takes what is queued. The first request's token is taken before
// the batch is cut, so the batch holds what arrived while it waited; false:
// ctx ended while waiting.
func (s *Record[T]) cutBatch(ctx context.Context) (*batch[T], bool) {
	b := &batch[T]{prepaid: s.wait != nil}
	if b.prepaid {
		if err := s.wait(ctx); err != nil {
			return nil, false
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	b.adds, b.removes = s.adds, s.removes
	s.adds, s.removes = map[string]*pendingAdd[T]{}, map[string]bool{}
	s.all.pending = 0
	now := time.Now()
	for d, a := range s.arrivals {
		if a.pending = 0; now.Sub(a.last) > s.batch.maxLinger {
			delete(s.arrivals, d) // idle: its next Add starts the count anew
		}
	}
	s.removing = b.removes
	if s.loaded {
		b.cached = s.cache
	}
	return b, true
}

// tryWrite writes the batch over the record, read first if need be. It
// returns nil once written (or once nothing is left to write), and again
// when the write met a newer or another record, which is read again.
func (s *Record[T]) tryWrite(ctx context.Context, b *batch[T]) (again bool, err error) {
	if b.cached == nil {
		if b.cached, err = s.get(ctx, &b.prepaid); err != nil {
			return false, err
		}
		// Another object than the record last known (deleted and made
		// again, after a failed write or between writes): its entries are
		// to be written back (noteReplacedLocked).
		s.mu.Lock()
		s.noteReplacedLocked(b.cached)
		s.setCacheLocked(b.cached)
		s.mu.Unlock()
	}
	cm := s.merge(b)
	if len(b.adds) == 0 && len(b.removes) == 0 && maps.Equal(cm.Data, b.cached.Data) {
		// Nothing to write (every Add failed): no API write spent.
		s.mu.Lock()
		s.removing = nil
		s.lost = nil // nothing of it was missing
		s.mu.Unlock()
		return false, nil
	}
	if err := s.take(ctx, &b.prepaid); err != nil {
		return false, err
	}
	updated, err := s.client.CoreV1().ConfigMaps(s.namespace).Update(ctx, cm, metav1.UpdateOptions{})
	s.mu.Lock()
	s.writes++
	s.mu.Unlock()
	if err == nil {
		s.mu.Lock()
		s.setCacheLocked(updated)
		s.loaded = true
		s.removing = nil
		s.lost = nil // written back, or never replaced
		s.mu.Unlock()
		b.finish(nil)
		return false, nil
	}
	if apierrors.IsConflict(err) || apierrors.IsNotFound(err) {
		// Read again; if it is another object, the entries of the one
		// written to are kept (noteReplacedLocked compares with it).
		s.mu.Lock()
		s.setCacheLocked(b.cached)
		s.mu.Unlock()
		b.cached = nil
		return true, err
	}
	return false, err
}

// merge is the record the batch writes: the cached one with the entries of
// a replaced record back, the batch's removes gone and its adds in. An Add
// that does not fit fails now (and leaves the batch): only what does not
// fit, since a ConfigMap holds at most 1 MiB.
func (s *Record[T]) merge(b *batch[T]) *corev1.ConfigMap {
	cm := b.cached.DeepCopy()
	if cm.Data == nil {
		cm.Data = map[string]string{}
	}
	// The entries of a replaced record go back in (merged into the
	// replacement, or into the record written to, whose write then fails
	// and reads it again); what is removed now is not to come back with
	// them.
	s.mu.Lock()
	for k, v := range s.lost {
		if _, ok := cm.Data[k]; !ok && !b.removes[k] {
			cm.Data[k] = v
		}
	}
	s.mu.Unlock()
	for k := range b.removes {
		delete(cm.Data, k)
	}
	size := 0
	for k, v := range cm.Data {
		size += len(k) + len(v)
	}
	var full []string
	for k, p := range b.adds {
		raw, merr := json.Marshal(p.intent)
		if merr != nil {
			p.done <- merr
			delete(b.adds, k)
			continue
		}
		if n := len(k) + len(raw); n > s.maxBytes {
			// Never fits, however empty the record: said so, not "too
			// many at once".
			p.done <- fmt.Errorf("%w: the intent of volume %s alone is %d bytes, over the record's %d (a class's parameters too large to record)", ErrTooLarge, k, n, s.maxBytes)
			delete(b.adds, k)
			continue
		}
		prev, exists := cm.Data[k]
		grow := len(k) + len(raw)
		if exists {
			grow = len(raw) - len(prev)
		}
		if (!exists && len(cm.Data) >= s.maxEntries) || size+grow > s.maxBytes {
			full = append(full, k)
			continue
		}
		size += grow
		cm.Data[k] = string(raw)
	}
	for _, k := range full {
		b.adds[k].done <- ErrFull
		delete(b.adds, k)
	}
	return cm
}

// batchFailed ends a batch whose write failed. Removes are retried with the
// next batch, or alone removeDelay from now (not at once: the API server
// may be struggling); Adds fail so their callers back off (nothing was
// called yet).
func (s *Record[T]) batchFailed(b *batch[T], err error) {
	err = fmt.Errorf("write intent record %s/%s: %w", s.namespace, s.name, err)
	s.log.Error("intent record write failed", "err", err)
	s.mu.Lock()
	for k := range b.removes {
		if _, readded := s.adds[k]; !readded {
			s.removes[k] = true
		}
	}
	s.removing = nil
	if len(b.removes) > 0 || s.lost != nil {
		s.firstRem = time.Now()
	}
	s.loaded = false
	s.mu.Unlock()
	b.finish(err)
}

// Record is the record's ConfigMap as the store last read or wrote it,
// read now if it has not been (other objects name it as their owner).
func (s *Record[T]) Record(ctx context.Context) (*corev1.ConfigMap, error) {
	return s.get(ctx, nil)
}

// LimitEntries bounds how many entries the record holds (1500 by default);
// an Add beyond it fails with ErrFull. Call it before Run.
func (s *Record[T]) LimitEntries(n int) { s.maxEntries = n }
