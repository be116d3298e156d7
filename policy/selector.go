package policy

import (
	"fmt"
	"sort"
)

// selector is a compiled LabelSelector.
type selector struct {
	labels []labelPair // matchLabels, sorted by key
	exprs  []requirement
}

type labelPair struct{ key, value string }

type requirement struct {
	key    string
	op     LabelSelectorOperator
	values []string
}

// compileSelector validates s. Problems are returned as messages prefixed
// with the field path.
func compileSelector(path string, s *LabelSelector) (*selector, []string) {
	var problems []string
	out := &selector{}
	keys := make([]string, 0, len(s.MatchLabels))
	for k := range s.MatchLabels {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		v := s.MatchLabels[k]
		if !labelKey(k) {
			problems = append(problems, fmt.Sprintf("%s.matchLabels: key %q is not a valid label key", path, k))
		}
		if !labelValue(v) {
			problems = append(problems, fmt.Sprintf("%s.matchLabels[%s]: %q is not a valid label value", path, k, v))
		}
		out.labels = append(out.labels, labelPair{k, v})
	}
	for i, e := range s.MatchExpressions {
		p := fmt.Sprintf("%s.matchExpressions[%d]", path, i)
		if !labelKey(e.Key) {
			problems = append(problems, fmt.Sprintf("%s.key: %q is not a valid label key", p, e.Key))
		}
		switch e.Operator {
		case LabelSelectorOpIn, LabelSelectorOpNotIn:
			if len(e.Values) == 0 {
				problems = append(problems, fmt.Sprintf("%s.values: must not be empty for operator %s", p, e.Operator))
			}
		case LabelSelectorOpExists, LabelSelectorOpDoesNotExist:
			if len(e.Values) != 0 {
				problems = append(problems, fmt.Sprintf("%s.values: must be empty for operator %s", p, e.Operator))
			}
		default:
			problems = append(problems, fmt.Sprintf("%s.operator: %q is not one of In, NotIn, Exists, DoesNotExist", p, e.Operator))
		}
		for _, v := range e.Values {
			if !labelValue(v) {
				problems = append(problems, fmt.Sprintf("%s.values: %q is not a valid label value", p, v))
			}
		}
		out.exprs = append(out.exprs, requirement{key: e.Key, op: e.Operator, values: append([]string(nil), e.Values...)})
	}
	return out, problems
}

// matches reports whether labels satisfy every requirement. nil labels mean
// "unknown" and never match, so a caller that did not look the namespace up
// cannot be admitted by a NotIn or DoesNotExist requirement by accident
// (rule.selects makes a Deny grant match them instead).
func (s *selector) matches(labels map[string]string) bool {
	if labels == nil {
		return false
	}
	for _, p := range s.labels {
		if v, ok := labels[p.key]; !ok || v != p.value {
			return false
		}
	}
	for i := range s.exprs {
		r := &s.exprs[i]
		v, ok := labels[r.key]
		switch r.op {
		case LabelSelectorOpIn:
			if !ok || !contains(r.values, v) {
				return false
			}
		case LabelSelectorOpNotIn:
			if ok && contains(r.values, v) {
				return false
			}
		case LabelSelectorOpExists:
			if !ok {
				return false
			}
		case LabelSelectorOpDoesNotExist:
			if ok {
				return false
			}
		default:
			return false
		}
	}
	return true
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}
