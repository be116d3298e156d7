//go:build clientgo

package main

import (
	"net/http"

	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
)

// The client-go layer: a clientset and a shared informer factory with the
// informers of the kinds a CSI provisioner and attacher watch, made but not
// started (there is no API server): what linking client-go's generated
// clients and every API group's types costs before any object is cached.
func init() {
	names = append(names, "client-go")
	layers = append(layers, func(_ *http.ServeMux, _ string) error {
		cs, err := kubernetes.NewForConfig(&rest.Config{Host: "http://127.0.0.1:1"})
		if err != nil {
			return err
		}
		f := informers.NewSharedInformerFactory(cs, 0)
		_ = f.Core().V1().PersistentVolumeClaims().Informer()
		_ = f.Core().V1().PersistentVolumes().Informer()
		_ = f.Core().V1().Nodes().Informer()
		_ = f.Storage().V1().StorageClasses().Informer()
		_ = f.Storage().V1().CSINodes().Informer()
		_ = f.Storage().V1().VolumeAttachments().Informer()
		return nil
	})
}
