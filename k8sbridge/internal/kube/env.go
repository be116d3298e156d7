package kube

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes/scheme"
	corelisters "k8s.io/client-go/listers/core/v1"
	storagelisters "k8s.io/client-go/listers/storage/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"

	"github.com/csibroker/csibroker/k8sbridge/intent"
	"github.com/csibroker/csibroker/k8sbridge/internal/drivers"
)

import ()

// Env is what every controller is given: the configuration, clients and
// listers of the shared informers, the Event recorder (with its memory of
// what was reported), the intent record and the drivers' capabilities.
// New builds it; the controllers' constructors add their informer handlers
// (On) and volume-change followers; StartHandlers ends that.
type Env struct {
	Cfg     Config
	Log     *slog.Logger
	Tracer  trace.Tracer
	Metrics *Metrics

	Factory     informers.SharedInformerFactory
	Claims      corelisters.PersistentVolumeClaimLister
	Volumes     corelisters.PersistentVolumeLister
	Classes     storagelisters.StorageClassLister
	Nodes       corelisters.NodeLister
	CSINodes    storagelisters.CSINodeLister
	Attachments storagelisters.VolumeAttachmentLister
	Namespaces  corelisters.NamespaceLister

	Recorder    record.EventRecorder
	Broadcaster record.EventBroadcaster
	// sent is what EventOnce recorded last on each object, per reason.
	sent    EventMemory
	Caps    *drivers.Cache
	Intents *intent.Store

	fans []*fanout // handlers being added (New), registered by StartHandlers
	// moreSynced are the HasSynced of informers the constructors added
	// (AddSynced), taken by the bridge (TakeSynced).
	moreSynced []cache.InformerSynced
	// VolumeChanged are told of each volume made or deleted (capacity
	// refreshes what it took or freed); set up by the constructors,
	// read-only after.
	VolumeChanged []func(VolumeChange)
}

// NewEnv builds the shared informers (over cfg.InformerClient, with the
// StripBulk transform), the Event recorder and the intent record, and
// returns what the informers' HasSynced are. cfg must be valid.
func NewEnv(cfg Config) (*Env, []cache.InformerSynced, error) {
	e := &Env{Cfg: cfg, Log: cfg.Logger.With("component", "k8sbridge"), Tracer: cfg.TracerProvider.Tracer("github.com/csibroker/csibroker/k8sbridge")}
	m, err := newMetrics(cfg.Registerer)
	if err != nil {
		return nil, nil, err
	}
	e.Metrics = m
	e.Factory = informers.NewSharedInformerFactoryWithOptions(cfg.InformerClient, cfg.ResyncPeriod, informers.WithTransform(StripBulk))
	claims := e.Factory.Core().V1().PersistentVolumeClaims()
	volumes := e.Factory.Core().V1().PersistentVolumes()
	classes := e.Factory.Storage().V1().StorageClasses()
	nodes := e.Factory.Core().V1().Nodes()
	csiNodes := e.Factory.Storage().V1().CSINodes()
	attachments := e.Factory.Storage().V1().VolumeAttachments()
	namespaces := e.Factory.Core().V1().Namespaces()
	e.Claims, e.Volumes, e.Classes = claims.Lister(), volumes.Lister(), classes.Lister()
	e.Nodes, e.CSINodes, e.Attachments, e.Namespaces = nodes.Lister(), csiNodes.Lister(), attachments.Lister(), namespaces.Lister()
	synced := []cache.InformerSynced{claims.Informer().HasSynced, volumes.Informer().HasSynced, classes.Informer().HasSynced,
		nodes.Informer().HasSynced, csiNodes.Informer().HasSynced, attachments.Informer().HasSynced, namespaces.Informer().HasSynced}

	e.Broadcaster = record.NewBroadcaster(record.WithContext(context.Background()))
	e.Recorder = e.Broadcaster.NewRecorder(scheme.Scheme, corev1.EventSource{Component: "csibroker", Host: cfg.Identity})
	e.Caps = drivers.NewCache(cfg.Drivers)
	e.Intents = intent.NewStore(cfg.Client, cfg.Namespace, "csibroker-intents", e.Log)
	if cfg.IntentClient != nil && cfg.IntentBudget != nil {
		e.Intents.UseBudget(cfg.IntentClient, cfg.IntentBudget.Wait)
	}
	e.Intents.UseReader(cfg.InformerClient)
	return e, synced, nil
}

// AddSynced adds an informer a constructor made on Factory to those whose
// caches the bridge waits for (and /readyz reports on).
func (b *Env) AddSynced(f cache.InformerSynced) { b.moreSynced = append(b.moreSynced, f) }

// TakeSynced returns what AddSynced collected, once.
func (b *Env) TakeSynced() []cache.InformerSynced {
	s := b.moreSynced
	b.moreSynced = nil
	return s
}

// StartHandlers registers the handlers On collected, one per informer.
func (b *Env) StartHandlers() error {
	for _, f := range b.fans {
		if _, err := f.inf.AddEventHandler(f); err != nil {
			return err
		}
	}
	b.fans = nil
	return nil
}

// ResetEvents forgets every Event EventOnce recorded: what was reported is
// of a term, and another leader may have reported other things since.
func (b *Env) ResetEvents() { b.sent.Reset() }

// Registered says whether driver is one of the broker's drivers.
func (b *Env) Registered(driver string) bool { return b.Cfg.Drivers.HasDriver(driver) }

// Foreign says whether driver is another replica's to work on (per-driver
// leader election: registered but led elsewhere); never without sharding.
// What is left of a driver (intent entries, capacity objects) is settled by
// its leader only.
func (b *Env) Foreign(driver string) bool { return drivers.Foreign(b.Cfg.Drivers, driver) }

// CallContext bounds one CSI call of method to driver (drivers.CallContext
// with --timeout).
func (b *Env) CallContext(ctx context.Context, driver, method string) (context.Context, context.CancelFunc) {
	return drivers.CallContext(ctx, b.Cfg.Drivers, b.Cfg.Timeout, driver, method)
}

// VolumeChange is a volume made or deleted at a driver, or a CreateVolume
// refused for want of room: where its storage is, as far as known.
type VolumeChange struct {
	Driver string
	Class  string              // "": any class of the driver (a pool serves them all)
	Node   string              // a node-local driver's node ("": not node-local, or not known)
	Topo   []map[string]string // the volume's accessible segments (none: not known)
}

// NoteVolumeChange tells the controllers that follow volumes (capacity).
func (b *Env) NoteVolumeChange(v VolumeChange) {
	for _, f := range b.VolumeChanged {
		f(v)
	}
}

// Deleted is the object of an informer's delete event as a T, unwrapped
// from the tombstone of a deletion seen only by a relist.
func Deleted[T any](obj any) (T, bool) {
	if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = t.Obj
	}
	o, ok := obj.(T)
	return o, ok
}

// On adds a controller's handler of inf's events. The handlers of one
// informer are registered as one (fanout): client-go runs each registered
// handler on goroutines of its own, so every event would wake two more
// goroutines per extra handler, on the path of every volume.
func (b *Env) On(inf cache.SharedIndexInformer, h cache.ResourceEventHandler) {
	for _, f := range b.fans {
		if f.inf == inf {
			f.hs = append(f.hs, h)
			return
		}
	}
	b.fans = append(b.fans, &fanout{inf: inf, hs: []cache.ResourceEventHandler{h}})
}

// fanout passes each event of one informer to several handlers, in the
// order they were added. Every handler only queues work.
type fanout struct {
	inf cache.SharedIndexInformer
	hs  []cache.ResourceEventHandler
}

func (f *fanout) OnAdd(obj any, isInInitialList bool) {
	for _, h := range f.hs {
		h.OnAdd(obj, isInInitialList)
	}
}

func (f *fanout) OnUpdate(oldObj, newObj any) {
	for _, h := range f.hs {
		h.OnUpdate(oldObj, newObj)
	}
}

func (f *fanout) OnDelete(obj any) {
	for _, h := range f.hs {
		h.OnDelete(obj)
	}
}

// EventRepeat is how long an Event that eventOnce recorded stands for the
// failure it reports: a failure that lasts is recorded again after it, so
// that its Event outlives the API server's Event lifetime (--event-ttl,
// one hour by default) instead of vanishing while the failure goes on.
const EventRepeat = 10 * time.Minute

// EventOnce records an Event as event does, unless the last Event with
// this reason that eventOnce recorded on obj (this term, since forgetEvents)
// was about the same thing, what, and less than eventRepeat ago. A failure
// retried with backoff is reported once instead of on every attempt (every
// Event carries its attempt's trace ID, so the recorder would write each
// one anew, on the Events' budget); the caller logs every attempt.
func (b *Env) EventOnce(ctx context.Context, obj corev1.ObjectReference, eventType, reason, what, format string, args ...any) {
	if ctx.Err() != nil {
		return // event records nothing either: nothing to remember
	}
	if !b.sent.First(obj.UID, reason, what, time.Now()) {
		b.Log.Debug("reported on the object already; no Event", "object", obj.Kind+" "+obj.Namespace+"/"+obj.Name, "reason", reason)
		return
	}
	b.Event(ctx, obj, eventType, reason, format, args...)
}

// FailureOf names err for eventOnce: a gRPC status (a driver's answer) by
// method and code, since drivers put what changes on every call (a request
// ID, an attempt counter) into their messages; anything else by its
// message.
func FailureOf(method string, err error) string {
	if errors.As(err, new(drivers.Unreachable)) {
		method = "unreachable" // the capabilities lookup's answer, not the method's
	}
	if st, ok := status.FromError(err); ok {
		return method + " " + st.Code().String()
	}
	return err.Error()
}

// ForgetEvents drops what eventOnce remembers of obj (it succeeded, or is
// gone): whatever comes next is news.
func (b *Env) ForgetEvents(obj types.UID) { b.sent.Forget(obj) }

// EventMemory is, per object and reason, what the last Event recorded was
// about and when: one entry per object and reason, dropped with the object
// (forget) and at each term's start (reset).
type EventMemory struct {
	mu   sync.Mutex
	last map[types.UID]map[string]sentEvent // object → reason → the last one
}

type sentEvent struct {
	what string
	at   time.Time
}

// First reports whether an Event about what, with reason, is to be
// recorded on obj at now: the last one was about something else, or
// eventRepeat ago or more. If so, it is remembered as the last.
func (m *EventMemory) First(obj types.UID, reason, what string, now time.Time) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	byReason := m.last[obj]
	if prev, ok := byReason[reason]; ok && prev.what == what && now.Sub(prev.at) < EventRepeat {
		return false
	}
	if byReason == nil {
		if m.last == nil {
			m.last = map[types.UID]map[string]sentEvent{}
		}
		byReason = map[string]sentEvent{}
		m.last[obj] = byReason
	}
	byReason[reason] = sentEvent{what, now}
	return true
}

func (m *EventMemory) Forget(obj types.UID) {
	m.mu.Lock()
	defer m.mu.Unlock()
	delete(m.last, obj)
}

func (m *EventMemory) Reset() {
	m.mu.Lock()
	defer m.mu.Unlock()
	clear(m.last)
}

// Event records an Event on obj with the trace ID of ctx's span, if any.
func (b *Env) Event(ctx context.Context, obj corev1.ObjectReference, eventType, reason, format string, args ...any) {
	msg := fmt.Sprintf(format, args...)
	if ctx.Err() != nil {
		// The leadership term (or the process) ended under the operation:
		// what failed is the cancellation, not the object, and the next
		// leader takes the object up again.
		b.Log.Debug("event not recorded: the term ended", "object", obj.Kind+" "+obj.Namespace+"/"+obj.Name, "reason", reason, "message", msg)
		return
	}
	if sc := trace.SpanContextFromContext(ctx); sc.IsValid() {
		msg += " (trace " + sc.TraceID().String() + ")"
	}
	b.Recorder.Event(&obj, eventType, reason, msg)
}

// SleepCtx waits d, or less if ctx ends first; it reports whether ctx is
// still live.
func SleepCtx(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// Len is how many objects m remembers Events of.
func (m *EventMemory) Len() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.last)
}
