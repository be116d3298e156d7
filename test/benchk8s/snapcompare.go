package main

import (
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"

	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
)

// contentFields flattens a ready VolumeSnapshotContent into the fields the
// two sides are compared on: every annotation, label and finalizer, the
// status and the spec, with what differs from run to run (object names,
// UIDs, the driver's handles, times) replaced by placeholders.
func contentFields(c *snapshotv1.VolumeSnapshotContent) map[string]string {
	norm := contentNormalizer(c)
	f := map[string]string{}
	for k, v := range c.Annotations {
		f["annotation "+k] = norm.Replace(v)
	}
	for k, v := range c.Labels {
		f["label "+k] = norm.Replace(v)
	}
	fin := slices.Clone(c.Finalizers)
	slices.Sort(fin)
	f["finalizers"] = strings.Join(fin, ",")
	f["spec.deletionPolicy"] = string(c.Spec.DeletionPolicy)
	f["spec.source.volumeHandle"] = setOrNot(c.Spec.Source.VolumeHandle)
	f["spec.source.snapshotHandle"] = setOrNot(c.Spec.Source.SnapshotHandle)
	f["spec.volumeSnapshotClassName"] = deref(c.Spec.VolumeSnapshotClassName)
	f["spec.sourceVolumeMode"] = deref((*string)(c.Spec.SourceVolumeMode))
	st := c.Status
	if st == nil {
		f["status"] = "<nil>"
		return f
	}
	f["status.snapshotHandle"] = setOrNot(st.SnapshotHandle)
	f["status.creationTime"] = "<unset>"
	if st.CreationTime != nil {
		f["status.creationTime"] = "<set>"
	}
	f["status.restoreSize"] = "<unset>"
	if st.RestoreSize != nil {
		f["status.restoreSize"] = strconv.FormatInt(*st.RestoreSize, 10)
	}
	f["status.readyToUse"] = "<unset>"
	if st.ReadyToUse != nil {
		f["status.readyToUse"] = strconv.FormatBool(*st.ReadyToUse)
	}
	f["status.error"] = "<unset>"
	if st.Error != nil {
		f["status.error"] = norm.Replace(deref(st.Error.Message))
	}
	f["status.volumeGroupSnapshotHandle"] = setOrNot(st.VolumeGroupSnapshotHandle)
	return f
}

// contentNormalizer replaces c's run-specific strings by placeholders.
func contentNormalizer(c *snapshotv1.VolumeSnapshotContent) *strings.Replacer {
	var pairs []string
	add := func(s, with string) {
		if s != "" {
			pairs = append(pairs, s, with)
		}
	}
	add(c.Name, "<content>")
	add(string(c.Spec.VolumeSnapshotRef.UID), "<snapshot-uid>")
	add(c.Spec.VolumeSnapshotRef.Name, "<snapshot>")
	add(c.Spec.VolumeSnapshotRef.Namespace, "<namespace>")
	if c.Status != nil {
		add(deref(c.Status.SnapshotHandle), "<handle>")
	}
	add(deref(c.Spec.Source.VolumeHandle), "<volume-handle>")
	return strings.NewReplacer(pairs...)
}

func deref(s *string) string {
	if s == nil {
		return "<unset>"
	}
	return *s
}

func setOrNot(s *string) string {
	if s == nil || *s == "" {
		return "<unset>"
	}
	return "<set>"
}

// fieldValues counts, field by field, the values seen over contents.
type fieldValues map[string]map[string]int

func collectFields(contents map[string]*snapshotv1.VolumeSnapshotContent) fieldValues {
	fv := fieldValues{}
	for _, c := range contents {
		for k, v := range contentFields(c) {
			if fv[k] == nil {
				fv[k] = map[string]int{}
			}
			fv[k][v]++
		}
	}
	return fv
}

// render shows a field's values, most common first, with counts when
// there is more than one value or the field is not on every content.
func (fv fieldValues) render(field string, n int) string {
	vals := fv[field]
	if len(vals) == 0 {
		return "(absent)"
	}
	keys := slices.SortedFunc(maps.Keys(vals), func(a, b string) int {
		if vals[a] != vals[b] {
			return vals[b] - vals[a]
		}
		return strings.Compare(a, b)
	})
	var parts []string
	total := 0
	for _, k := range keys {
		total += vals[k]
		if len(vals) == 1 && vals[k] == n {
			parts = append(parts, "`"+k+"`")
		} else {
			parts = append(parts, fmt.Sprintf("`%s` (%d)", k, vals[k]))
		}
	}
	if total < n {
		parts = append(parts, fmt.Sprintf("absent (%d)", n-total))
	}
	return strings.Join(parts, ", ")
}

// fieldsTable prints one side's final contents field by field.
func (h *Harness) fieldsTable(title, side string, contents map[string]*snapshotv1.VolumeSnapshotContent) {
	fv := collectFields(contents)
	var sb strings.Builder
	fmt.Fprintf(&sb, "\n### %s\n\n| field | %s (%d contents) |\n|---|---|\n", title, side, len(contents))
	for _, f := range slices.Sorted(maps.Keys(fv)) {
		fmt.Fprintf(&sb, "| %s | %s |\n", f, fv.render(f, len(contents)))
	}
	h.report.printf("%s", sb.String())
}

// compareTable prints the two sides' final contents field by field and
// returns how many fields differ.
func (h *Harness) compareTable(title string, a, b map[string]*snapshotv1.VolumeSnapshotContent) int {
	fa, fb := collectFields(a), collectFields(b)
	fields := slices.Sorted(maps.Keys(fa))
	for k := range fb {
		if _, ok := fa[k]; !ok {
			fields = append(fields, k)
		}
	}
	slices.Sort(fields)
	var sb strings.Builder
	fmt.Fprintf(&sb, "\n### %s\n\n| field | csi-snapshotter (%d contents) | csibroker (%d contents) | same |\n|---|---|---|---|\n", title, len(a), len(b))
	differ := 0
	for _, f := range fields {
		ra, rb := fa.render(f, len(a)), fb.render(f, len(b))
		same := "yes"
		if ra != rb {
			same, differ = "**no**", differ+1
		}
		fmt.Fprintf(&sb, "| %s | %s | %s | %s |\n", f, ra, rb, same)
	}
	h.report.printf("%s", sb.String())
	return differ
}
