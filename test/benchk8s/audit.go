package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"maps"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"
)

// kube-apiserver v1.36's apiserver_request_total has no client label (its
// labels are verb, dry_run, group, version, resource, subresource, scope,
// component, code), and the test control plane has one admin token. So API
// requests are counted per client from the apiserver's audit log, whose
// events carry the user agent: Metadata level for every request, one event
// when a request completes, plus one when a WATCH starts.
const auditPolicy = `apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived"]
rules:
- level: Metadata
`

// auditLog reads the apiserver's audit log by byte offsets.
type auditLog struct {
	path string
}

// mark returns the current end of the log (of its complete lines).
func (a *auditLog) mark() int64 {
	st, err := os.Stat(a.path)
	if err != nil {
		return 0
	}
	return st.Size()
}

// settle waits until the log stops growing for a moment (in-flight requests
// of a stopped process are written), at most timeout.
func (a *auditLog) settle(ctx context.Context, quiet, timeout time.Duration) int64 {
	end := time.Now().Add(timeout)
	last := a.mark()
	for time.Now().Before(end) {
		select {
		case <-ctx.Done():
			return last
		case <-time.After(quiet):
		}
		m := a.mark()
		if m == last {
			return m
		}
		last = m
	}
	return last
}

// auditEvent is the part of an audit.k8s.io/v1 Event the harness reads.
type auditEvent struct {
	Stage     string `json:"stage"`
	Verb      string `json:"verb"`
	UserAgent string `json:"userAgent"`
	ObjectRef *struct {
		Resource    string `json:"resource"`
		Subresource string `json:"subresource"`
		Namespace   string `json:"namespace"`
		Name        string `json:"name"`
	} `json:"objectRef"`
	ResponseStatus *struct {
		Code int `json:"code"`
	} `json:"responseStatus"`
	RequestURI string `json:"requestURI"`
}

// read returns the events between two marks.
func (a *auditLog) read(from, to int64) ([]auditEvent, error) {
	f, err := os.Open(a.path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if to <= from {
		return nil, nil
	}
	buf := make([]byte, to-from)
	if _, err := f.ReadAt(buf, from); err != nil && err != io.EOF {
		return nil, err
	}
	// Only whole lines: the first mark is always at a line end; the last
	// may cut one being written.
	if i := bytes.LastIndexByte(buf, '\n'); i >= 0 {
		buf = buf[:i+1]
	}
	var evs []auditEvent
	for line := range bytes.SplitSeq(buf, []byte("\n")) {
		if len(line) == 0 {
			continue
		}
		var ev auditEvent
		if err := json.Unmarshal(line, &ev); err != nil {
			continue
		}
		evs = append(evs, ev)
	}
	return evs, nil
}

// client names the component a request came from, by user agent:
// "csi-provisioner", "csi-attacher", "csibroker(objects)", "csibroker(events)",
// "csibroker(leader-election)", "minprov" (-floor), or "" for everything else (the
// controller-manager, the harness).
func client(userAgent string) string {
	switch {
	case strings.HasPrefix(userAgent, "csi-provisioner/"):
		return "csi-provisioner"
	case strings.HasPrefix(userAgent, "csi-attacher/"):
		return "csi-attacher"
	case strings.HasPrefix(userAgent, "csi-snapshotter/"):
		return "csi-snapshotter"
	case strings.HasPrefix(userAgent, "snapshot-controller/"):
		return "snapshot-controller"
	case strings.HasPrefix(userAgent, "minprov/"):
		return "minprov"
	case strings.HasPrefix(userAgent, "csibroker/"):
		if i := strings.LastIndexByte(userAgent, '('); i >= 0 && strings.HasSuffix(userAgent, ")") {
			return "csibroker(" + userAgent[i+1:len(userAgent)-1] + ")"
		}
		return "csibroker"
	}
	return ""
}

// apiCounts counts requests of one side by "verb resource" (resource with
// "/subresource"), all its clients together, plus by client.
type apiCounts struct {
	ByVerbResource map[string]int `json:"by_verb_resource"`
	ByClient       map[string]int `json:"by_client"`
	// WatchesOpen is WATCH requests started minus ended in the window,
	// WatchesOpenBy the same by resource.
	WatchesOpen   int            `json:"watches_open"`
	WatchesOpenBy map[string]int `json:"watches_open_by_resource"`
}

// countAPI counts the requests made by clients whose name has one of the
// prefixes ("csi-provisioner", "csibroker", ...). A WATCH counts once, when it
// starts; every other request when it completes.
func countAPI(evs []auditEvent, prefixes ...string) apiCounts {
	c := apiCounts{ByVerbResource: map[string]int{}, ByClient: map[string]int{}, WatchesOpenBy: map[string]int{}}
	for _, ev := range evs {
		cl := client(ev.UserAgent)
		if cl == "" || !slices.ContainsFunc(prefixes, func(p string) bool { return strings.HasPrefix(cl, p) }) {
			continue
		}
		res := "-"
		if ev.ObjectRef != nil {
			res = ev.ObjectRef.Resource
			if ev.ObjectRef.Subresource != "" {
				res += "/" + ev.ObjectRef.Subresource
			}
		}
		isWatch := ev.Verb == "watch"
		switch {
		case isWatch && ev.Stage == "ResponseStarted":
			c.WatchesOpen++
			c.WatchesOpenBy[res]++
		case isWatch && ev.Stage == "ResponseComplete":
			c.WatchesOpen--
			c.WatchesOpenBy[res]--
			continue
		case ev.Stage != "ResponseComplete":
			continue
		}
		c.ByVerbResource[ev.Verb+" "+res]++
		c.ByClient[cl]++
	}
	return c
}

var writeVerbs = []string{"create", "update", "patch", "delete", "deletecollection"}

// total returns the requests whose verb is in verbs (all if none), leaving
// out resources in skip.
func (c apiCounts) total(verbs []string, skip ...string) int {
	n := 0
	for k, v := range c.ByVerbResource {
		verb, res, _ := strings.Cut(k, " ")
		if len(verbs) > 0 && !slices.Contains(verbs, verb) {
			continue
		}
		if slices.Contains(skip, res) {
			continue
		}
		n += v
	}
	return n
}

// String renders "create persistentvolumes 300, create events 12, ...".
func (c apiCounts) String() string {
	keys := slices.Sorted(maps.Keys(c.ByVerbResource))
	var parts []string
	for _, k := range keys {
		parts = append(parts, k+" "+strconv.Itoa(c.ByVerbResource[k]))
	}
	return strings.Join(parts, ", ")
}
