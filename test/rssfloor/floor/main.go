// Command floor is one layer of test/rssfloor: a process that does what a
// csibroker proxy's libraries need to be resident for, and no more, then
// prints its resident memory. Build tags add layers (see the runner).
//
// The base layer, always: an mTLS handshake over loopback TCP with
// certificates made here (ECDSA P-256, ALPN h2), one HTTP/2 request and
// answer written and read with x/net/http2's Framer and hpack (what the
// proxy's frame relay uses), and one GET of /healthz from a net/http server.
package main

import (
	"bufio"
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"os"
	"runtime"
	"strings"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// layers are the optional layers' steps, added by the tagged files' init.
var layers []func(mux *http.ServeMux, base string) error

// names are the layers built in, for the report line.
var names = []string{"transport"}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "floor:", err)
		os.Exit(1)
	}
}

func run() error {
	mux := http.NewServeMux()
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) { io.WriteString(w, "ok") })
	mux.HandleFunc("/v1/traces", func(w http.ResponseWriter, r *http.Request) { io.Copy(io.Discard, r.Body) })
	hl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go srv.Serve(hl)
	defer srv.Close()
	base := "http://" + hl.Addr().String()
	if err := get(base + "/healthz"); err != nil {
		return err
	}
	if err := h2Exchange(); err != nil {
		return err
	}
	for _, l := range layers {
		if err := l(mux, base); err != nil {
			return err
		}
	}
	runtime.GC()
	time.Sleep(2 * time.Second)
	return report()
}

func get(url string) error {
	resp, err := http.Get(url)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	_, err = io.Copy(io.Discard, resp.Body)
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	return err
}

// report prints "layers VmRSS RssFile RssAnon" in KiB.
func report() error {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return err
	}
	v := map[string]string{}
	for _, l := range strings.Split(string(b), "\n") {
		k, val, ok := strings.Cut(l, ":")
		if ok {
			v[k] = strings.TrimSuffix(strings.TrimSpace(val), " kB")
		}
	}
	fmt.Printf("%s %s %s %s\n", strings.Join(names, "+"), v["VmRSS"], v["RssFile"], v["RssAnon"])
	return nil
}

// h2Exchange makes a CA, a server and a client certificate, and sends one
// gRPC-shaped request over mTLS with HTTP/2 framing, answered in kind.
func h2Exchange() error {
	caKey, ca, caDER, err := cert("ca", nil, nil, true)
	if err != nil {
		return err
	}
	pool := x509.NewCertPool()
	pool.AddCert(ca)
	leaf := func(name string) (tls.Certificate, error) {
		k, _, der, err := cert(name, ca, caKey, false)
		return tls.Certificate{Certificate: [][]byte{der, caDER}, PrivateKey: k}, err
	}
	sc, err := leaf("server")
	if err != nil {
		return err
	}
	cc, err := leaf("client")
	if err != nil {
		return err
	}
	ln, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{
		Certificates: []tls.Certificate{sc}, ClientCAs: pool, ClientAuth: tls.RequireAndVerifyClientCert,
		NextProtos: []string{"h2"}, MinVersion: tls.VersionTLS13,
	})
	if err != nil {
		return err
	}
	defer ln.Close()
	errc := make(chan error, 1)
	go func() { errc <- serveOne(ln) }()
	c, err := tls.Dial("tcp", ln.Addr().String(), &tls.Config{
		Certificates: []tls.Certificate{cc}, RootCAs: pool, ServerName: "server", NextProtos: []string{"h2"}, MinVersion: tls.VersionTLS13,
	})
	if err != nil {
		return err
	}
	defer c.Close()
	if _, err := io.WriteString(c, http2.ClientPreface); err != nil {
		return err
	}
	fr := http2.NewFramer(c, bufio.NewReader(c))
	if err := fr.WriteSettings(); err != nil {
		return err
	}
	var hb bytes.Buffer
	enc := hpack.NewEncoder(&hb)
	for _, f := range [][2]string{{":method", "POST"}, {":scheme", "https"}, {":path", "/csi.v1.Identity/Probe"}, {":authority", "server"}, {"content-type", "application/grpc"}, {"te", "trailers"}} {
		if err := enc.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]}); err != nil {
			return err
		}
	}
	if err := fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: hb.Bytes(), EndHeaders: true}); err != nil {
		return err
	}
	if err := fr.WriteData(1, true, []byte{0, 0, 0, 0, 0}); err != nil {
		return err
	}
	if err := readToEnd(fr); err != nil {
		return err
	}
	return <-errc
}

// readToEnd reads frames (header blocks decoded) until a DATA frame that
// ends its stream.
func readToEnd(fr *http2.Framer) error {
	fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			return err
		}
		if d, ok := f.(*http2.DataFrame); ok && d.StreamEnded() {
			return nil
		}
	}
}

func serveOne(ln net.Listener) error {
	c, err := ln.Accept()
	if err != nil {
		return err
	}
	defer c.Close()
	br := bufio.NewReader(c)
	preface := make([]byte, len(http2.ClientPreface))
	if _, err := io.ReadFull(br, preface); err != nil {
		return err
	}
	fr := http2.NewFramer(c, br)
	if err := fr.WriteSettings(); err != nil {
		return err
	}
	if err := readToEnd(fr); err != nil {
		return err
	}
	var hb bytes.Buffer
	enc := hpack.NewEncoder(&hb)
	for _, f := range [][2]string{{":status", "200"}, {"content-type", "application/grpc"}} {
		if err := enc.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]}); err != nil {
			return err
		}
	}
	if err := fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: hb.Bytes(), EndHeaders: true}); err != nil {
		return err
	}
	return fr.WriteData(1, true, []byte{0, 0, 0, 0, 0})
}

func cert(cn string, parent *x509.Certificate, parentKey *ecdsa.PrivateKey, isCA bool) (*ecdsa.PrivateKey, *x509.Certificate, []byte, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano()), Subject: pkix.Name{CommonName: cn}, DNSNames: []string{cn},
		NotBefore: time.Now().Add(-time.Minute), NotAfter: time.Now().Add(time.Hour),
		IsCA: isCA, BasicConstraintsValid: true,
		KeyUsage:    x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
	}
	if parent == nil {
		parent, parentKey = tmpl, key
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, parent, &key.PublicKey, parentKey)
	if err != nil {
		return nil, nil, nil, err
	}
	c, err := x509.ParseCertificate(der)
	return key, c, der, err
}
