package policy

// Name checks, written out by hand (no regexp, no apimachinery): they run on
// every decision for the request fields and once per grant at compile time.

func isAlnum(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9'
}

func isLowerAlnum(c byte) bool { return c >= 'a' && c <= 'z' || c >= '0' && c <= '9' }

// safeName: 1..max characters of [A-Za-z0-9._-]. Used on request fields that
// end up in reasons, logs and Events.
func safeName(s string, max int) bool {
	if s == "" || len(s) > max {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !isAlnum(c) && c != '.' && c != '-' && c != '_' {
			return false
		}
	}
	return true
}

// optSafeName is safeName, but empty is fine.
func optSafeName(s string, max int) bool { return s == "" || safeName(s, max) }

// dnsLabel: RFC 1123 label, as Kubernetes namespaces.
func dnsLabel(s string) bool {
	if s == "" || len(s) > 63 || !isLowerAlnum(s[0]) || !isLowerAlnum(s[len(s)-1]) {
		return false
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; !isLowerAlnum(c) && c != '-' {
			return false
		}
	}
	return true
}

// dnsSubdomain: RFC 1123 subdomain, as most Kubernetes object names.
func dnsSubdomain(s string) bool {
	if s == "" || len(s) > 253 || !isLowerAlnum(s[0]) || !isLowerAlnum(s[len(s)-1]) {
		return false
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; !isLowerAlnum(c) && c != '-' && c != '.' {
			return false
		}
	}
	return true
}

// dnsSubdomainPrefix: a non-empty prefix of some DNS subdomain.
func dnsSubdomainPrefix(s string) bool {
	if s == "" || len(s) > 252 || !isLowerAlnum(s[0]) {
		return false
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; !isLowerAlnum(c) && c != '-' && c != '.' {
			return false
		}
	}
	return true
}

// labelName: the name part of a label key, or a label value when non-empty:
// at most 63 characters, alphanumeric at both ends, [-_.A-Za-z0-9] between.
func labelName(s string) bool {
	if s == "" || len(s) > 63 || !isAlnum(s[0]) || !isAlnum(s[len(s)-1]) {
		return false
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; !isAlnum(c) && c != '-' && c != '_' && c != '.' {
			return false
		}
	}
	return true
}

// labelKey: [prefix/]name with prefix a DNS subdomain.
func labelKey(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] == '/' {
			return dnsSubdomain(s[:i]) && labelName(s[i+1:])
		}
	}
	return labelName(s)
}

// labelValue: empty, or a labelName.
func labelValue(s string) bool { return s == "" || labelName(s) }
