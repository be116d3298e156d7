package csiname

import (
	"strings"
	"testing"
)

func TestCheck(t *testing.T) {
	for name, want := range map[string]string{
		"sample.csibroker.io":   "",
		"a":                     "",
		"Ebs.CSI-driver.2":      "",
		strings.Repeat("a", 63): "",
		"":                      "empty",
		strings.Repeat("a", 64): "at most 63",
		"-a":                    "begin and end",
		"a.":                    "begin and end",
		"my_driver":             `'_'`,
		"a/b":                   `'/'`,
		"a b":                   `' '`,
		"dri\u00e9ver":          "letters, digits",
	} {
		err := Check(name)
		switch {
		case want == "" && err != nil:
			t.Errorf("Check(%q) = %v, want nil", name, err)
		case want != "" && (err == nil || !strings.Contains(err.Error(), want)):
			t.Errorf("Check(%q) = %v, want an error saying %q", name, err, want)
		}
		if Valid(name) != (want == "") {
			t.Errorf("Valid(%q) = %v", name, Valid(name))
		}
	}
}
