package redisfleet_test

import (
	"flag"
	"fmt"
	"os"
	"sync"
	"testing"

	"go.uber.org/goleak"

	"github.com/herdguard/herdguard/internal/redistest"
)

// TestMain checks for leaked goroutines once the tests and examples have
// run, after stopping the examples' redis-server. The examples need
// redis-server: without it they are skipped, saying how to get it, unless
// under CI (CI=true), where they fail.
func TestMain(m *testing.M) {
	flag.Parse()
	if _, err := redistest.Find(); err != nil && os.Getenv("CI") != "true" {
		skip := "^Example"
		if prev := flag.Lookup("test.skip").Value.String(); prev != "" {
			skip = prev + "|" + skip
		}
		_ = flag.Set("test.skip", skip)
		fmt.Fprintf(os.Stderr, "redisfleet: the examples are skipped: %v\n", err)
	}
	code := m.Run()
	examples.stop()
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintf(os.Stderr, "goleak: errors on a successful test run: %v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}

// exampleRedis is the redis-server the examples share: started by the
// first that asks for it, stopped by TestMain.
type exampleRedis struct {
	once sync.Once
	srv  *redistest.Server
	dir  string
	err  error
}

var examples exampleRedis

// redisForExamples returns the address of the examples' redis-server on
// 127.0.0.1, starting it on first use.
func redisForExamples() string {
	r := &examples
	r.once.Do(func() {
		bin, err := redistest.Find()
		if err != nil {
			r.err = fmt.Errorf("%w (CI installs it: .ci/run)", err)
			return
		}
		if r.dir, r.err = os.MkdirTemp("", "redisfleet-example-"); r.err != nil {
			return
		}
		r.srv, r.err = redistest.StartServer(bin, r.dir)
	})
	if r.err != nil {
		panic(fmt.Sprintf("redisfleet: the examples need redis-server: %v", r.err))
	}
	return r.srv.Addr
}

func (r *exampleRedis) stop() {
	if r.srv != nil {
		r.srv.Stop()
	}
	if r.dir != "" {
		os.RemoveAll(r.dir)
	}
}
