package policy

// The SecretGrant custom resource (deploy/crds/policy.csibroker.io_secretgrants.yaml).
const (
	APIGroup   = "policy.csibroker.io"
	APIVersion = "policy.csibroker.io/v1alpha1"
	Kind       = "SecretGrant"
	ListKind   = "SecretGrantList"
	Resource   = "secretgrants"
)

// Status condition types and reasons a controller reports on a SecretGrant.
const (
	// ConditionValid: the grant compiled (True) or not (False, with the
	// RuleError message).
	ConditionValid = "Valid"
	// ConditionReady: the grant is part of the rule set the broker decides
	// with. An invalid Allow grant is never Ready; an invalid Deny grant is
	// applied fail-closed (see Compile).
	ConditionReady = "Ready"

	ReasonCompiled   = "Compiled"
	ReasonInvalid    = "Invalid"
	ReasonApplied    = "Applied"
	ReasonFailClosed = "FailClosed"
	ReasonNotApplied = "NotApplied"
)

// Action is what a matching grant does.
type Action string

// Actions. A matching Deny grant beats any number of matching Allow grants.
const (
	ActionAllow Action = "Allow"
	ActionDeny  Action = "Deny"
)

// Wildcard in drivers, secretNames, operations or requesters.namespaces
// matches anything in that field. In secretNames a trailing "*" after a
// prefix ("tenant-*") matches names with that prefix.
const Wildcard = "*"

// Grant is a SecretGrant object as plain data: where it lives and its spec.
// A grant in namespace N can only ever admit secrets in namespace N.
type Grant struct {
	Namespace string
	Name      string
	// Generation is metadata.generation, copied into RuleError so a
	// controller can set observedGeneration. Optional.
	Generation int64
	Spec       GrantSpec
}

// Key is "namespace/name", the value of Decision.Rule for this grant.
func (g *Grant) Key() string { return g.Namespace + "/" + g.Name }

// GrantSpec is the SecretGrant spec. Its JSON tags are the CRD's field names,
// so runtime.DefaultUnstructuredConverter can fill it from an unstructured
// object's "spec". Every list that says who or what is admitted must be
// non-empty: an empty list admits nobody, and Compile rejects it rather than
// carrying a grant that can never match.
type GrantSpec struct {
	// Action is Allow (the default when empty) or Deny.
	Action Action `json:"action,omitempty"`
	// Drivers are CSI driver names; "*" is any driver. Required.
	Drivers []string `json:"drivers"`
	// SecretNames are names of secrets in the grant's namespace: exact
	// names, prefixes ending in "*" ("tenant-*"), or "*" for every secret in
	// the namespace. Required.
	SecretNames []string `json:"secretNames"`
	// Operations are CSI operations (see Operations); "*" is all of them.
	// Required.
	Operations []Operation `json:"operations"`
	// Requesters say on whose behalf. Required.
	Requesters Requesters `json:"requesters"`
	// Condition is an optional CEL expression over `request` that must
	// evaluate to true (see the package documentation for its fields).
	Condition string `json:"condition,omitempty"`
}

// Requesters select the requesting objects a grant admits. The requester's
// namespace must match namespaces or namespaceSelector (at least one of the
// two is required); storageClasses and nodes, when set, narrow further.
type Requesters struct {
	// Namespaces are requesting namespace names; "*" is every requester,
	// including cluster-scoped ones with no namespace.
	Namespaces []string `json:"namespaces,omitempty"`
	// NamespaceSelector selects requesting namespaces by their labels. An
	// empty selector ({}) selects every namespace (not requests without
	// one). When the namespace labels are not known it fails closed: an
	// Allow grant's selector selects nothing, a Deny grant's everything.
	NamespaceSelector *LabelSelector `json:"namespaceSelector,omitempty"`
	// StorageClasses, when set, are the StorageClass names the request must
	// come through. Omitted means any StorageClass, including none; an
	// explicitly empty list is rejected as ambiguous.
	StorageClasses []string `json:"storageClasses,omitempty"`
	// Nodes, when set, are the node names a node operation (or a controller
	// operation bound to a node) must be for. Omitted means any node,
	// including none; an explicitly empty list is rejected. A node
	// operation's secret decided before its node is known (a volume that
	// any node may use: its node stage secret is decided at provisioning)
	// fails closed: a Deny grant naming nodes matches it, an Allow grant
	// naming nodes does not.
	Nodes []string `json:"nodes,omitempty"`
}

// LabelSelector has the shape and meaning of Kubernetes'
// metav1.LabelSelector: all matchLabels and all matchExpressions must hold.
type LabelSelector struct {
	MatchLabels      map[string]string          `json:"matchLabels,omitempty"`
	MatchExpressions []LabelSelectorRequirement `json:"matchExpressions,omitempty"`
}

// LabelSelectorOperator is In, NotIn, Exists or DoesNotExist.
type LabelSelectorOperator string

// Label selector operators.
const (
	LabelSelectorOpIn           LabelSelectorOperator = "In"
	LabelSelectorOpNotIn        LabelSelectorOperator = "NotIn"
	LabelSelectorOpExists       LabelSelectorOperator = "Exists"
	LabelSelectorOpDoesNotExist LabelSelectorOperator = "DoesNotExist"
)

// LabelSelectorRequirement is one matchExpressions entry.
type LabelSelectorRequirement struct {
	Key      string                `json:"key"`
	Operator LabelSelectorOperator `json:"operator"`
	Values   []string              `json:"values,omitempty"`
}
