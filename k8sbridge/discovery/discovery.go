package discovery

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"reflect"
	"sort"
	"strconv"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	corelisters "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"
	"k8s.io/utils/clock"

	"github.com/csibroker/csibroker/broker"
	"github.com/csibroker/csibroker/internal/csiname"
	"github.com/csibroker/csibroker/k8sbridge/internal/kube"
)

// Pod annotations that make a pod a proxy of a driver. The pods are found by
// a label selector (--discover-proxies); a proxy never calls in.
const (
	AnnDriver    = "csibroker.io/driver"
	AnnProxyPort = "csibroker.io/proxy-port"
	// AnnNodeProxy "true": the pod fronts the driver's node plugin on its node.
	AnnNodeProxy = "csibroker.io/node-proxy"
	// AnnNodeLocal "true": the driver's volumes live on one node.
	AnnNodeLocal = "csibroker.io/node-local"
	// DefaultProxyPort is used when a pod does not name its port.
	DefaultProxyPort = 7443
)

// Reasons of the Warning Events discovery records on proxy pods it cannot
// use as they stand.
const (
	// ReasonProxyAnnotationInvalid: the driver annotation is missing, or
	// the port annotation is not a port.
	ReasonProxyAnnotationInvalid = "ProxyAnnotationInvalid"
	// ReasonProxyOutsideNamespaces: the pod matches the selector in a
	// namespace proxies are not discovered in.
	ReasonProxyOutsideNamespaces = "ProxyOutsideNamespaces"
	// ReasonProxyShadowed: the pod names a driver of the static registry,
	// whose entry is used instead.
	ReasonProxyShadowed = "ProxyShadowedByStaticDriver"
	// ReasonProxyRegistrationFailed: the broker refused the driver's
	// configuration built from its pods.
	ReasonProxyRegistrationFailed = "ProxyRegistrationFailed"
	// ReasonProxyNotUsed: another ready pod is the driver's controller
	// proxy (or the node's proxy), or the pods of one driver disagree
	// about node-local.
	ReasonProxyNotUsed = "ProxyNotUsed"
)

// discoveryGoneGrace is how long a discovered driver with no Ready proxy
// pod left stays registered, as it was, before it is removed: a proxy that
// fails a readiness probe or two, or a rollout that stops the old pod
// before the new one is Ready, costs its calls a retry (the old address
// refuses them), not the driver's registration (an unknown driver's
// objects are skipped until the next resync).
const discoveryGoneGrace = 30 * time.Second

// discoveryLeaderPoll is how often Run looks whether this replica leads, so
// that a new leader records the Events of the problems that stand.
const discoveryLeaderPoll = 2 * time.Second

// Problem is a proxy pod discovery cannot use as it stands, and why.
type Problem struct {
	Pod     *corev1.Pod
	Reason  string // of the Event on the pod
	Message string // says what is wrong, not which pod
}

func (p Problem) String() string {
	return fmt.Sprintf("pod %s/%s: %s", p.Pod.Namespace, p.Pod.Name, p.Message)
}

// Registry is the part of the broker that discovery updates.
type Registry interface {
	SetDriver(cfg broker.DriverConfig) error
	RemoveDriver(name string)
}

// Discovery turns proxy pods into driver registrations. Drivers named in the
// static registry are left alone.
type Discovery struct {
	client   kubernetes.Interface
	selector string
	registry Registry
	template broker.DriverConfig // timeouts and retries for discovered drivers
	static   map[string]bool
	// namespaces where proxy pods may be (empty: every namespace).
	namespaces map[string]bool
	log        *slog.Logger

	factory informers.SharedInformerFactory
	pods    corelisters.PodLister
	synced  cache.InformerSynced
	kick    chan struct{}

	// warned holds the warnings of the last sync (sync runs on Run's
	// goroutine only): one that stands is logged once, not at every pod
	// event.
	warned map[string]bool

	// Events on problem pods (ReportTo): recorded by the leader only, once
	// while a problem stands; evented holds those of the last sync.
	recorder   record.EventRecorder
	leading    func() bool
	leaderPoll time.Duration // discoveryLeaderPoll; tests shorten it
	evented    map[string]bool

	mu      sync.Mutex
	current map[string]broker.DriverConfig
	// goneSince: when each registered driver was first seen with no
	// Ready proxy pod (removed after goneGrace; a test shortens it), and
	// the timer that syncs again when the first grace ends.
	goneSince map[string]time.Time
	goneGrace time.Duration
	goneTimer clock.Timer
	// clock measures the grace (a test steps a fake one).
	clock clock.WithDelayedExecution
}

// New watches pods matching selector in namespaces (all namespaces
// when none is given). Restricting it to the namespaces where drivers'
// proxies run keeps tenants who can create pods elsewhere from offering
// proxies: mTLS would refuse an impostor, but it could hold the driver's
// route (the first Ready pod by name is a driver's controller proxy).
func New(client kubernetes.Interface, selector string, namespaces []string, registry Registry, template broker.DriverConfig, static []string, log *slog.Logger) (*Discovery, error) {
	if _, err := labels.Parse(selector); err != nil {
		return nil, fmt.Errorf("proxy discovery selector %q: %w", selector, err)
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	d := &Discovery{client: client, selector: selector, registry: registry, template: template, static: map[string]bool{}, log: log.With("component", "discovery"),
		kick: make(chan struct{}, 1), current: map[string]broker.DriverConfig{}, leaderPoll: discoveryLeaderPoll,
		goneSince: map[string]time.Time{}, goneGrace: discoveryGoneGrace, clock: clock.RealClock{}}
	for _, s := range static {
		d.static[s] = true
	}
	opts := []informers.SharedInformerOption{informers.WithTweakListOptions(func(o *metav1.ListOptions) { o.LabelSelector = selector }), informers.WithTransform(kube.StripBulk)}
	switch len(namespaces) {
	case 0:
		d.log.Warn("proxy pods are discovered in every namespace", "selector", selector,
			"risk", "anyone who can create a pod can offer one and take a driver's route", "fix", "set --discover-proxies-namespace")
	case 1:
		opts = append(opts, informers.WithNamespace(namespaces[0]))
	}
	if len(namespaces) > 0 {
		// More than one: one watch of every namespace's matching pods,
		// those of other namespaces ignored (and said so).
		d.namespaces = map[string]bool{}
		for _, n := range namespaces {
			d.namespaces[n] = true
		}
	}
	d.factory = informers.NewSharedInformerFactoryWithOptions(client, 0, opts...)
	pods := d.factory.Core().V1().Pods()
	d.pods, d.synced = pods.Lister(), pods.Informer().HasSynced
	if _, err := pods.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: func(any) { d.nudge() }, UpdateFunc: func(_, _ any) { d.nudge() }, DeleteFunc: func(any) { d.nudge() },
	}); err != nil {
		return nil, err
	}
	return d, nil
}

// ReportTo makes discovery record a Warning Event on each proxy pod it
// cannot use (a missing or bad annotation, a namespace proxies are not
// discovered in, a driver of the static registry, a configuration the
// broker refuses), besides its log line. Every replica discovers; only the
// one for which leading reports true records, so a problem gets one Event
// and not one per replica. Call it before Run.
func (d *Discovery) ReportTo(rec record.EventRecorder, leading func() bool) {
	d.recorder, d.leading = rec, leading
}

func (d *Discovery) nudge() {
	select {
	case d.kick <- struct{}{}:
	default:
	}
}

// HasSynced reports whether the pod cache is filled.
func (d *Discovery) HasSynced() bool { return d.synced() }

// Run keeps the registry in step with the proxy pods until ctx is done.
func (d *Discovery) Run(ctx context.Context) error {
	d.factory.Start(ctx.Done())
	defer d.factory.Shutdown()
	defer func() {
		d.mu.Lock()
		if d.goneTimer != nil {
			d.goneTimer.Stop()
		}
		d.mu.Unlock()
	}()
	if !cache.WaitForCacheSync(ctx.Done(), d.synced) {
		return ctx.Err()
	}
	if d.recorder != nil && d.leading != nil {
		// Read before the first sync: a change after it is one to act on.
		go d.watchLeadership(ctx, d.leading())
	}
	for {
		d.sync()
		select {
		case <-ctx.Done():
			return nil
		case <-d.kick:
			// Coalesce a burst of pod changes (a rollout) into one update.
			if !kube.SleepCtx(ctx, 100*time.Millisecond) {
				return nil
			}
		}
	}
}

// watchLeadership syncs again when this replica becomes the leader (it
// led or not when Run read leading), so the Events of the problems that
// stand are recorded by it.
func (d *Discovery) watchLeadership(ctx context.Context, leading bool) {
	tick := time.NewTicker(d.leaderPoll)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		now := d.leading()
		if now && !leading {
			d.nudge()
		}
		leading = now
	}
}

// DriversFromPods computes driver configurations from proxy pods: the
// first ready pod (by name) that is not a node proxy is the controller
// proxy; node proxies are keyed by their pod's node. Pods without an IP,
// being deleted, or not Ready are skipped.
func DriversFromPods(pods []*corev1.Pod, template broker.DriverConfig) (map[string]broker.DriverConfig, []Problem) {
	sort.Slice(pods, func(i, j int) bool { return pods[i].Namespace+"/"+pods[i].Name < pods[j].Namespace+"/"+pods[j].Name })
	out := map[string]broker.DriverConfig{}
	var problems []Problem
	// used: the pod each route was taken from, by driver then "" (the
	// controller) or node; localBy and notLocal: a pod of each driver that
	// says node-local, and those that do not.
	used := map[string]map[string]*corev1.Pod{}
	localBy, notLocal := map[string]*corev1.Pod{}, map[string][]*corev1.Pod{}
	for _, p := range pods {
		name := p.Annotations[AnnDriver]
		if name == "" {
			problems = append(problems, Problem{Pod: p, Reason: ReasonProxyAnnotationInvalid,
				Message: fmt.Sprintf("matches the proxy selector but has no %s annotation naming its driver; ignored", AnnDriver)})
			continue
		}
		if err := csiname.Check(name); err != nil {
			problems = append(problems, Problem{Pod: p, Reason: ReasonProxyAnnotationInvalid,
				Message: fmt.Sprintf("annotation %s: %v; ignored", AnnDriver, err)})
			continue
		}
		if p.DeletionTimestamp != nil || p.Status.PodIP == "" || !podReady(p) {
			continue
		}
		port := DefaultProxyPort
		if s := p.Annotations[AnnProxyPort]; s != "" {
			n, err := strconv.Atoi(s)
			if err != nil || n <= 0 || n > 65535 {
				problems = append(problems, Problem{Pod: p, Reason: ReasonProxyAnnotationInvalid,
					Message: fmt.Sprintf("%s %q is not a port (1-65535); the pod is not used as a proxy of %s", AnnProxyPort, s, name)})
				continue
			}
			port = n
		}
		addr := net.JoinHostPort(p.Status.PodIP, strconv.Itoa(port))
		cfg, ok := out[name]
		if !ok {
			cfg = template
			cfg.Name = name
			cfg.Controller, cfg.Nodes, cfg.NodeLocal = nil, nil, false
		}
		if p.Annotations[AnnNodeLocal] == "true" {
			cfg.NodeLocal = true
			if localBy[name] == nil {
				localBy[name] = p
			}
		} else {
			notLocal[name] = append(notLocal[name], p)
		}
		route := "" // the controller's
		if p.Annotations[AnnNodeProxy] == "true" {
			if p.Spec.NodeName == "" {
				continue
			}
			route = p.Spec.NodeName
		}
		if used[name] == nil {
			used[name] = map[string]*corev1.Pod{}
		}
		if first := used[name][route]; first != nil {
			// Standing by, or an impostor or a proxy left behind: only
			// one is used, and if it is not the real proxy, the driver's
			// calls fail its TLS identity check; said once here.
			what := "the controller proxy of " + name
			if route != "" {
				what = "the proxy of " + name + " on node " + route
			}
			problems = append(problems, Problem{Pod: p, Reason: ReasonProxyNotUsed,
				Message: fmt.Sprintf("not used: pod %s/%s (first by name) is %s", first.Namespace, first.Name, what)})
			out[name] = cfg
			continue
		}
		used[name][route] = p
		if route != "" {
			cfg.Nodes = append(cfg.Nodes, broker.ProxyConfig{Node: route, Address: addr})
		} else {
			cfg.Controller = &broker.ProxyConfig{Address: addr}
		}
		out[name] = cfg
	}
	for name, by := range localBy {
		for _, p := range notLocal[name] {
			problems = append(problems, Problem{Pod: p, Reason: ReasonProxyNotUsed,
				Message: fmt.Sprintf("has no %s=true annotation, but pod %s/%s of driver %s has: the driver is node-local (CreateVolume, DeleteVolume and GetCapacity go to node proxies)", AnnNodeLocal, by.Namespace, by.Name, name)})
		}
	}
	return out, problems
}

func podReady(p *corev1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

func (d *Discovery) sync() {
	pods, err := d.pods.List(labels.Everything())
	if err != nil {
		d.log.Error("list proxy pods", "err", err)
		return
	}
	now := map[string]bool{}
	warn := func(level slog.Level, msg string, args ...any) {
		key := fmt.Sprint(append([]any{msg}, args...)...)
		now[key] = true
		if !d.warned[key] {
			d.log.Log(context.Background(), level, msg, args...)
		}
	}
	defer func() { d.warned = now }()
	// A problem is logged once while it stands (warn) and, by the leader,
	// recorded once as an Event on its pod.
	leading := d.recorder != nil && (d.leading == nil || d.leading())
	evented := map[string]bool{}
	defer func() { d.evented = evented }()
	report := func(level slog.Level, p Problem) {
		warn(level, "proxy discovery: a pod cannot be used as a proxy", "pod", p.Pod.Namespace+"/"+p.Pod.Name, "reason", p.Reason, "problem", p.Message)
		if !leading {
			return
		}
		key := string(p.Pod.UID) + "\x00" + p.Reason + "\x00" + p.Message
		evented[key] = true
		if !d.evented[key] {
			d.recorder.Event(p.Pod, corev1.EventTypeWarning, p.Reason, p.Message)
		}
	}
	if d.namespaces != nil {
		mine := pods[:0]
		for _, p := range pods {
			if d.namespaces[p.Namespace] {
				mine = append(mine, p)
			} else {
				report(slog.LevelWarn, Problem{Pod: p, Reason: ReasonProxyOutsideNamespaces,
					Message: fmt.Sprintf("matches the proxy selector in namespace %s, where proxies are not discovered (--discover-proxies-namespace); ignored", p.Namespace)})
			}
		}
		pods = mine
	}
	want, problems := DriversFromPods(pods, d.template)
	for _, p := range problems {
		report(slog.LevelWarn, p)
	}
	// The pods offering each driver, to report what concerns the driver.
	podsOf := func(driver string) []*corev1.Pod {
		var of []*corev1.Pod
		for _, p := range pods {
			if p.Annotations[AnnDriver] == driver && p.DeletionTimestamp == nil {
				of = append(of, p)
			}
		}
		return of
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	for name, cfg := range want {
		if d.static[name] {
			for _, p := range podsOf(name) {
				report(slog.LevelWarn, Problem{Pod: p, Reason: ReasonProxyShadowed,
					Message: fmt.Sprintf("names driver %s, which the broker's static registry configures; the static entry is used and this pod is not", name)})
			}
			continue
		}
		if prev, ok := d.current[name]; ok && reflect.DeepEqual(prev, cfg) {
			continue
		}
		if err := d.registry.SetDriver(cfg); err != nil {
			for _, p := range podsOf(name) {
				report(slog.LevelError, Problem{Pod: p, Reason: ReasonProxyRegistrationFailed,
					Message: fmt.Sprintf("the broker refused driver %s as its proxy pods describe it: %v", name, err)})
			}
			continue
		}
		d.current[name] = cfg
		d.log.Info("driver discovered", "driver", name, "controller", cfg.Controller != nil, "node_proxies", len(cfg.Nodes))
	}
	var next time.Duration // until the first grace ends (0: none runs)
	for name, cur := range d.current {
		// Back as registered (a configuration the broker refused leaves
		// the old one, stale: still gone).
		if w, ok := want[name]; ok && reflect.DeepEqual(w, cur) {
			if _, was := d.goneSince[name]; was {
				delete(d.goneSince, name)
				d.log.Info("driver's proxy is ready again", "driver", name)
			}
			continue
		}
		since, ok := d.goneSince[name]
		if !ok {
			since = d.clock.Now()
			d.goneSince[name] = since
			d.log.Warn("driver has no ready proxy pod; kept registered while one may come back", "driver", name, "grace", d.goneGrace)
		}
		if wait := d.goneGrace - d.clock.Since(since); wait > 0 {
			if next == 0 || wait < next {
				next = wait
			}
			continue
		}
		d.registry.RemoveDriver(name)
		delete(d.current, name)
		delete(d.goneSince, name)
		d.log.Info("driver gone: no ready proxy pod left", "driver", name, "for", d.goneGrace)
	}
	if next > 0 {
		// A new timer each time, not Reset: a fired fake clock timer
		// cannot be reset (its channel is full).
		if d.goneTimer != nil {
			d.goneTimer.Stop()
		}
		d.goneTimer = d.clock.AfterFunc(next, d.nudge)
	}
}
