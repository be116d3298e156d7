package csiparams

import (
	"strings"
	"testing"
)

func TestCheckPublished(t *testing.T) {
	big := strings.Repeat("x", MaxPublishContextBytes/2)
	for _, c := range []struct {
		name string
		pc   map[string]string
		want string // "" for accepted
	}{
		{"none", nil, ""},
		{"usual", map[string]string{"devicePath": "/dev/sdb", "lun": "3"}, ""},
		{"empty key and value", map[string]string{"": ""}, ""},
		{"exactly the limit", map[string]string{"k": big[2:], "v": big}, ""},
		{"one byte over", map[string]string{"k": big[1:], "v": big}, "more than the 262144"},
		{"key not UTF-8", map[string]string{"a\xffb": "v"}, "key (3 bytes) is not valid UTF-8"},
		{"value not UTF-8", map[string]string{"k": "\xc3("}, "value of a key of 1 bytes is not valid UTF-8"},
	} {
		t.Run(c.name, func(t *testing.T) {
			err := CheckPublished(c.pc)
			if c.want == "" {
				if err != nil {
					t.Fatalf("refused: %v", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), "ControllerPublishVolume") {
				t.Fatalf("err %v, want one naming ControllerPublishVolume and saying %q", err, c.want)
			}
		})
	}
}

// TestCheckPublishedQuotesNothing: the error names neither keys nor values
// (a publish context may carry what reaches the volume).
func TestCheckPublishedQuotesNothing(t *testing.T) {
	const secret = "s3cr3t-chap-password"
	for _, pc := range []map[string]string{
		{secret + "\xff": "v"},
		{"k": secret + "\xff"},
		{secret: strings.Repeat(secret, MaxPublishContextBytes/len(secret))},
	} {
		err := CheckPublished(pc)
		if err == nil {
			t.Fatalf("%d bytes accepted", len(pc))
		}
		if strings.Contains(err.Error(), secret) {
			t.Fatalf("error quotes the publish context: %v", err)
		}
	}
}
