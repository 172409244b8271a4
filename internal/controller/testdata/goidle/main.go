// Command goidle is the floor a Go program's resident memory has under
// gVisor's accounting: it starts and then idles, as the supervisor does
// between calls. With "bare" it only sleeps; with "https" it first
// listens with net/http and crypto/tls (a self-signed certificate made at
// start), as the supervisor's serving does before any call. It prints
// nothing; TestSupervisorGVisorBench reads its /proc status.
package main

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"os"
	"time"
)

func main() {
	if len(os.Args) != 2 || (os.Args[1] != "bare" && os.Args[1] != "https") {
		fmt.Fprintln(os.Stderr, "usage: goidle bare|https")
		os.Exit(2)
	}
	if os.Args[1] == "https" {
		if err := serve(); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
	}
	for {
		time.Sleep(time.Hour)
	}
}

func serve() error {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	tpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "goidle"},
		NotBefore: time.Now(), NotAfter: time.Now().Add(time.Hour)}
	der, err := x509.CreateCertificate(rand.Reader, tpl, tpl, &key.PublicKey, key)
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	srv := &http.Server{
		Handler:   http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok")) }),
		TLSConfig: &tls.Config{Certificates: []tls.Certificate{{Certificate: [][]byte{der}, PrivateKey: key}}},
	}
	go func() { _ = srv.ServeTLS(ln, "", "") }()
	return nil
}
