package csiparams

import (
	"fmt"
	"unicode/utf8"
)

// MaxPublishContextBytes is the most a VolumeAttachment's
// status.attachmentMetadata may hold, its keys and values counted
// together: the API server refuses a bigger one (storage validation,
// maxAttachedVolumeMetadataSize). It checks nothing else of the map: no
// key syntax, no count (each entry costs at least its key's bytes, so
// the size bounds the count too).
const MaxPublishContextBytes = 256 << 10

// CheckPublished checks a driver's ControllerPublishVolume answer, whose
// publish context the attach controller writes into the attachment's
// status.attachmentMetadata, before it is used: what the API server would
// refuse (a status write failing on every retry, with a message that does
// not name the driver) and what a JSON write would silently change
// (strings that are not UTF-8; the proto decoder refuses them on the
// wire, a driver in-process may not) are refused here, saying why. The
// error names no value and quotes no key: a publish context may carry
// what the node needs to reach the volume.
func CheckPublished(publishContext map[string]string) error {
	size := 0
	for k, v := range publishContext {
		size += len(k) + len(v)
		if !utf8.ValidString(k) {
			return fmt.Errorf("the driver's ControllerPublishVolume answer: a publish_context key (%d bytes) is not valid UTF-8", len(k))
		}
		if !utf8.ValidString(v) {
			return fmt.Errorf("the driver's ControllerPublishVolume answer: the publish_context value of a key of %d bytes is not valid UTF-8", len(k))
		}
	}
	if size > MaxPublishContextBytes {
		return fmt.Errorf("the driver's ControllerPublishVolume answer: publish_context holds %d entries of %d bytes (keys and values), more than the %d a VolumeAttachment's status.attachmentMetadata may hold",
			len(publishContext), size, MaxPublishContextBytes)
	}
	return nil
}
