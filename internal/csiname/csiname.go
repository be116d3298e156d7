// Package csiname checks CSI driver names, the one rule every part of
// csibroker applies to them: the registry, proxy discovery, the certs
// subcommand, the sample driver and the policy engine.
//
// The CSI spec (GetPluginInfo) says a name is at most 63 characters, begins
// and ends with an alphanumeric character, and has only dashes, dots and
// alphanumerics between. Such a name is also a valid path segment of the
// proxy's SPIFFE ID and of a front-end socket's file name.
package csiname

import "fmt"

// MaxLen is the longest name the CSI spec allows.
const MaxLen = 63

// Valid reports whether name follows the CSI spec's rule.
func Valid(name string) bool { return Check(name) == nil }

// Check says what is wrong with name, or returns nil.
func Check(name string) error {
	switch {
	case name == "":
		return fmt.Errorf("driver name is empty")
	case len(name) > MaxLen:
		return fmt.Errorf("driver name %q is %d characters long; CSI allows at most %d", name, len(name), MaxLen)
	case !alnum(name[0]) || !alnum(name[len(name)-1]):
		return fmt.Errorf("driver name %q must begin and end with a letter or digit (CSI)", name)
	}
	for i := 0; i < len(name); i++ {
		if c := name[i]; !alnum(c) && c != '-' && c != '.' {
			return fmt.Errorf("driver name %q has %q at %d; CSI allows letters, digits, '-' and '.' only", name, c, i)
		}
	}
	return nil
}

func alnum(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9'
}
