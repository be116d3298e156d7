package snapshots

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"strings"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/tools/cache"

	"github.com/csibroker/csibroker/internal/budget"
	"github.com/csibroker/csibroker/k8sbridge/internal/kube"
)

// Content is a content type: *VolumeSnapshotContent or
// *VolumeGroupSnapshotContent.
type Content[C any] interface {
	metav1.Object
	DeepCopy() C
}

// Lister is the part of a content lister the shared steps read.
type Lister[C any] interface {
	Get(name string) (C, error)
	List(selector labels.Selector) ([]C, error)
}

// Contents is what the shared steps of a content controller know of its
// content type C; the controller fills in the functions.
type Contents[C Content[C]] struct {
	What   string // "snapshot", "group snapshot": for spans and log lines
	Kind   string // "VolumeSnapshotContent", "VolumeGroupSnapshotContent"
	Env    *kube.Env
	Queue  *kube.TermQueue
	Slots  *kube.DriverSlots
	Lister Lister[C]
	// Fetch reads a content from the API server (the cache may lag).
	Fetch  func(ctx context.Context, name string) (C, error)
	Ours   func(C) bool
	Driver func(C) string
	// Ref is the (group) snapshot the content is bound to.
	Ref   func(C) corev1.ObjectReference
	Class func(C) *string
	Ready func(C) bool
	// Recorded: the status records the driver's snapshot.
	Recorded func(C) bool
	// KeepStatus sets cur's status to old's (for NeedsSync).
	KeepStatus func(cur, old C)
	// AnyReadyChange: readiness changing either way needs a sync, not
	// only a content becoming ready.
	AnyReadyChange bool
	// NotReady is the error of a step that waits for readiness.
	NotReady error
	// Mark is the being-created annotation.
	Mark string
}

// Sync is the frame of one content's step: the content from the cache
// (gone, or not ours: nothing to do), a slot of its driver (none free:
// asked again when one is), the driver's API budget and a span.
func (s *Contents[C]) Sync(ctx context.Context, key string, step func(context.Context, C) error) (time.Duration, error) {
	c, err := s.Lister.Get(key)
	if apierrors.IsNotFound(err) {
		return 0, nil
	}
	if err != nil || !s.Ours(c) {
		return 0, err
	}
	driver := s.Driver(c)
	if !s.Slots.Acquire(driver, key) {
		return kube.WaitForSlot, nil
	}
	defer s.Slots.Release(driver)
	ctx = budget.WithDriver(ctx, driver)
	ctx, span := s.Env.Tracer.Start(ctx, s.What+" content "+key, trace.WithSpanKind(trace.SpanKindInternal), trace.WithAttributes(s.attributes(c, key)...))
	defer span.End()
	return 0, step(ctx, c)
}

// attributes are the span's: the driver, the content's name and its
// (group) snapshot's, as k8s.volumesnapshotcontent.name,
// k8s.volumesnapshot.namespace and k8s.volumesnapshot.name (and the
// group's likewise).
func (s *Contents[C]) attributes(c C, key string) []attribute.KeyValue {
	snap := "k8s." + strings.ToLower(strings.TrimSuffix(s.Kind, "Content"))
	ref := s.Ref(c)
	return []attribute.KeyValue{attribute.String("csi.driver", s.Driver(c)), attribute.String(snap+"content.name", key),
		attribute.String(snap+".namespace", ref.Namespace), attribute.String(snap+".name", ref.Name)}
}

// Work runs the queue's workers over sync, and extra beside them, while
// this replica leads (kube.TermQueue.Work); the term starts with every
// content queued.
func (s *Contents[C]) Work(ctx context.Context, sync func(context.Context, string) (time.Duration, error), extra ...func(context.Context)) {
	s.Queue.Work(ctx, s.Env.Cfg.WorkerThreads, s.EnqueueAll, func(ctx context.Context, key string) (time.Duration, error) {
		requeue, err := sync(ctx, key)
		switch {
		case errors.Is(err, s.NotReady):
			s.Env.Log.Debug(s.What+" not ready yet; asked again with backoff", "content", key)
		case err != nil:
			s.Env.Log.Debug(s.What+" content will be retried", "content", key, "err", err)
		}
		return requeue, err
	}, extra...)
}

// EnqueueAll queues every content of a registered driver (start of a
// term, a driver registered).
func (s *Contents[C]) EnqueueAll() { s.enqueue(s.Ours) }

// EnqueueClass queues the contents of class that are not ready (a class
// change matters to nothing else).
func (s *Contents[C]) EnqueueClass(class string) {
	s.enqueue(func(c C) bool {
		n := s.Class(c)
		return n != nil && *n == class && !s.Ready(c) && s.Ours(c)
	})
}

func (s *Contents[C]) enqueue(want func(C) bool) {
	all, err := s.Lister.List(labels.Everything())
	if err != nil {
		return
	}
	for _, c := range all {
		if want(c) {
			s.Queue.Add(c.GetName())
		}
	}
}

// NeedsSync is csi-snapshotter's filter of content updates: a resync, a
// readiness change (becoming ready; either way with AnyReadyChange), or a
// change of anything but the status, the finalizers, managed fields and
// the being-created mark (the controller's own writes, which would
// otherwise bypass the key's backoff).
func (s *Contents[C]) NeedsSync(old, cur C) bool {
	was, is := s.Ready(old), s.Ready(cur)
	if old.GetResourceVersion() == cur.GetResourceVersion() || (was != is && (is || s.AnyReadyChange)) {
		return true
	}
	c := cur.DeepCopy()
	s.KeepStatus(c, old)
	c.SetResourceVersion(old.GetResourceVersion())
	c.SetManagedFields(old.GetManagedFields())
	c.SetFinalizers(old.GetFinalizers())
	c.SetAnnotations(AnnotationsOutside(old.GetAnnotations(), c.GetAnnotations(), s.Mark))
	return !equality.Semantic.DeepEqual(old, c)
}

// Handler is the content informer's: a content of ours is queued when it
// is added, or updated as NeedsSync says; a deleted one's Events and key
// are forgotten, and gone is told.
func (s *Contents[C]) Handler(gone func(C)) cache.ResourceEventHandler {
	return cache.ResourceEventHandlerFuncs{
		AddFunc: func(obj any) {
			if c, ok := obj.(C); ok && s.Ours(c) {
				s.Queue.Add(c.GetName())
			}
		},
		UpdateFunc: func(oldObj, newObj any) {
			old, ok1 := oldObj.(C)
			cur, ok2 := newObj.(C)
			if ok1 && ok2 && s.Ours(cur) && s.NeedsSync(old, cur) {
				s.Queue.Add(cur.GetName())
			}
		},
		DeleteFunc: func(obj any) {
			c, ok := kube.Deleted[C](obj)
			if !ok {
				return
			}
			s.Env.ForgetEvents(c.GetUID())
			s.Queue.Forget(c.GetName())
			gone(c)
		},
	}
}

// ClassHandler is the informer's of class type K: a class that arrives
// (or changes) after its contents has them looked at again rather than
// waiting out their backoff.
func ClassHandler[K metav1.Object, C Content[C]](s *Contents[C]) cache.ResourceEventHandler {
	return cache.ResourceEventHandlerFuncs{
		AddFunc: func(obj any) {
			if cl, ok := obj.(K); ok {
				s.EnqueueClass(cl.GetName())
			}
		},
		UpdateFunc: func(_, newObj any) {
			if cl, ok := newObj.(K); ok {
				s.EnqueueClass(cl.GetName())
			}
		},
	}
}

// Annotate is a change that adds ann to a content's annotations.
func Annotate[C metav1.Object](ann map[string]string) func(C) {
	return func(c C) {
		a := c.GetAnnotations()
		if a == nil {
			a = map[string]string{}
		}
		maps.Copy(a, ann)
		c.SetAnnotations(a)
	}
}

// Served reports whether the API server serves groupVersion with its
// content and class resources (the CRDs are installed).
func Served(d discovery.DiscoveryInterface, groupVersion, contents, classes string) (bool, error) {
	list, err := d.ServerResourcesForGroupVersion(groupVersion)
	if apierrors.IsNotFound(err) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("discover the %s API: %w", groupVersion, err)
	}
	have := map[string]bool{}
	for _, r := range list.APIResources {
		have[r.Name] = true
	}
	return have[contents] && have[classes], nil
}
