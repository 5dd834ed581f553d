// SPDX-License-Identifier: Apache-2.0
// The Go peer of turnstile's etcd:// Mutex: etcd's own client, concurrency.Mutex on one
// session, Lock + Unlock in a loop for a fixed time. Prints one JSON object (pairs per second).
// Built offline from Debian's golang-etcd-server-dev by bench/all.py:
//   GO111MODULE=off GOPATH=/usr/share/gocode go build -o DIR/etcd_mutex bench/peers/etcd_mutex
//   etcd_mutex ENDPOINT SECONDS        (ENDPOINT: 127.0.0.1:2379)
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"time"

	"go.etcd.io/etcd/clientv3"
	"go.etcd.io/etcd/clientv3/concurrency"
)

func fail(err error) {
	fmt.Fprintln(os.Stderr, err)
	os.Exit(1)
}

func main() {
	if len(os.Args) < 3 {
		fmt.Fprintln(os.Stderr, "usage: etcd_mutex ENDPOINT SECONDS")
		os.Exit(64)
	}
	seconds, err := strconv.ParseFloat(os.Args[2], 64)
	if err != nil {
		fail(err)
	}
	client, err := clientv3.New(clientv3.Config{Endpoints: []string{os.Args[1]}, DialTimeout: 5 * time.Second})
	if err != nil {
		fail(err)
	}
	defer client.Close()
	session, err := concurrency.NewSession(client, concurrency.WithTTL(30))
	if err != nil {
		fail(err)
	}
	defer session.Close()
	mutex := concurrency.NewMutex(session, "bench/go-mutex")
	ctx := context.Background()
	pair := func() {
		if err := mutex.Lock(ctx); err != nil {
			fail(err)
		}
		if err := mutex.Unlock(ctx); err != nil {
			fail(err)
		}
	}
	for i := 0; i < 200; i++ { // warm up the connection
		pair()
	}
	pairs := 0
	start := time.Now()
	deadline := start.Add(time.Duration(seconds * float64(time.Second)))
	for time.Now().Before(deadline) {
		pair()
		pairs++
	}
	elapsed := time.Since(start).Seconds()
	out, _ := json.Marshal(map[string]interface{}{"mode": "go-etcd-mutex", "pairs": pairs, "seconds": elapsed, "per_second": float64(pairs) / elapsed})
	fmt.Println(string(out))
}
