// Package grants keeps a policy.Store in step with the cluster's SecretGrant
// objects: a dynamic informer over every namespace, each grant compiled into
// the store's rule set, and (on the leader only) each grant's status written
// back (valid, ready, why not).
//
// It decides nothing itself: the policy package decides, over the rules
// this package loads. Every replica runs it, so a standby takes over with
// warm rules.
package grants
