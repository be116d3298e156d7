package main

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/rest"
)

// The clients of built-in kinds send and ask for the encoding of
// --kube-api-content-type; an unknown encoding is refused by name.
func TestBuiltinClientEncoding(t *testing.T) {
	for _, tc := range []struct {
		contentType, wantAccept string
	}{
		{runtime.ContentTypeProtobuf, runtime.ContentTypeProtobuf + "," + runtime.ContentTypeJSON},
		{runtime.ContentTypeJSON, runtime.ContentTypeJSON + ", */*"}, // client-go's default
	} {
		t.Run(tc.contentType, func(t *testing.T) {
			var mu sync.Mutex
			var gotType, gotAccept string
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				mu.Lock()
				gotType, gotAccept = r.Header.Get("Content-Type"), r.Header.Get("Accept")
				mu.Unlock()
				http.Error(w, "refused by the test", http.StatusTeapot)
			}))
			defer srv.Close()
			f := &kubeFlags{ContentType: tc.contentType}
			c, err := f.builtinClient(&rest.Config{Host: srv.URL})
			if err != nil {
				t.Fatal(err)
			}
			_, err = c.CoreV1().ConfigMaps("ns").Create(context.Background(), &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "cm"}}, metav1.CreateOptions{})
			if err == nil {
				t.Fatal("create succeeded against a server that refuses every request")
			}
			mu.Lock()
			defer mu.Unlock()
			if gotType != tc.contentType {
				t.Errorf("Content-Type %q, want %q", gotType, tc.contentType)
			}
			if gotAccept != tc.wantAccept {
				t.Errorf("Accept %q, want %q", gotAccept, tc.wantAccept)
			}
		})
	}

	f := &kubeFlags{Mode: "off", PolicyMode: "enforce", QPS: 5, Burst: 10, EventsQPS: 20, EventsBurst: 50,
		LeaseDuration: 3e9, RenewDeadline: 2e9, ContentType: "application/yaml"}
	err := f.validate()
	if err == nil || !strings.Contains(err.Error(), "--kube-api-content-type") {
		t.Errorf("validate of an unknown encoding: %v, want an error naming --kube-api-content-type", err)
	}
	f.ContentType = runtime.ContentTypeProtobuf
	if err := f.validate(); err != nil {
		t.Errorf("validate of the default encoding: %v", err)
	}
}
