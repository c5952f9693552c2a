package redisfleet_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sony/gobreaker/v2"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/herdguard/herdguard"
	"github.com/herdguard/herdguard/breaker"
	"github.com/herdguard/herdguard/interceptor"
	"github.com/herdguard/herdguard/internal/redistest"
	"github.com/herdguard/herdguard/internal/testutil"
	"github.com/herdguard/herdguard/redisfleet"
)

// gobreakerStore is gobreaker's SharedDataStore over go-redis, as its
// documentation sketches it: a SET NX lock, and the state as one value.
type gobreakerStore struct{ c *redis.Client }

var errLocked = errors.New("locked")

func (s gobreakerStore) Lock(name string) error {
	ok, err := s.c.SetNX(context.Background(), name, 1, 5*time.Second).Result()
	if err == nil && !ok {
		return errLocked
	}
	return err
}

func (s gobreakerStore) Unlock(name string) error {
	return s.c.Del(context.Background(), name).Err()
}

func (s gobreakerStore) GetData(name string) ([]byte, error) {
	b, err := s.c.Get(context.Background(), name).Bytes()
	if errors.Is(err, redis.Nil) {
		return nil, nil
	}
	return b, err
}

func (s gobreakerStore) SetData(name string, data []byte) error {
	return s.c.Set(context.Background(), name, data, 0).Err()
}

// breakers returns a healthy call through each breaker compared: the
// replica's own, herdguard's shared one over Redis, and gobreaker's
// DistributedCircuitBreaker over the same Redis.
func breakers(b *testing.B, addr string) map[string]func() {
	local, err := breaker.New(scope, breaker.Settings{})
	if err != nil {
		b.Fatal(err)
	}
	shared := newReplica(b, addr, breaker.Settings{}, redisfleet.Options{})
	dcb, err := gobreaker.NewDistributedCircuitBreaker[struct{}](gobreakerStore{client(b, addr)}, gobreaker.Settings{Name: "bench"})
	if err != nil {
		b.Fatal(err)
	}
	ok := func(bool) herdguard.Verdict { return herdguard.Success }
	return map[string]func(){
		"own":                   func() { local.Execute(ok) },
		"shared":                func() { shared.b.Execute(ok) },
		"gobreaker-distributed": func() { _, _ = dcb.Execute(func() (struct{}, error) { return struct{}{}, nil }) },
	}
}

// BenchmarkHealthyCall is one healthy call through each breaker, alone
// (the call itself does nothing), with the Redis commands it costs.
func BenchmarkHealthyCall(b *testing.B) {
	srv := redistest.Start(b)
	all := breakers(b, srv.Addr)
	for _, name := range []string{"own", "shared", "gobreaker-distributed"} {
		b.Run(name, func(b *testing.B) {
			call := all[name]
			before := commands(b, srv.Addr)
			b.ReportAllocs()
			for b.Loop() {
				call()
			}
			b.ReportMetric(float64(commands(b, srv.Addr)-before-1)/float64(b.N), "redis-cmds/op")
		})
	}
}

// BenchmarkHealthyCallParallel is the same from 8 goroutines at once, as a
// busy replica makes calls: gobreaker's distributed breaker holds one lock
// in Redis across each call, and a caller that finds it taken sleeps 500 ms.
func BenchmarkHealthyCallParallel(b *testing.B) {
	srv := redistest.Start(b)
	all := breakers(b, srv.Addr)
	for _, name := range []string{"own", "shared", "gobreaker-distributed"} {
		b.Run(name, func(b *testing.B) {
			call := all[name]
			b.SetParallelism(4)
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					call()
				}
			})
		})
	}
}

// BenchmarkInterceptorAlone is a healthy unary call through the
// interceptor with the replica's own breaker and with the fleet's shared
// one; the invoker does nothing, so the interceptor runs alone.
func BenchmarkInterceptorAlone(b *testing.B) {
	srv := redistest.Start(b)
	cc, err := grpc.NewClient("passthrough:///bench", grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		b.Fatal(err)
	}
	defer cc.Close()
	f, err := redisfleet.New(redisfleet.Options{Client: client(b, srv.Addr)})
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	invoker := func(context.Context, string, any, any, *grpc.ClientConn, ...grpc.CallOption) error { return nil }
	for _, bc := range []struct {
		name string
		s    breaker.Settings
	}{{"own", breaker.Settings{}}, {"shared", breaker.Settings{Fleet: f}}} {
		b.Run(bc.name, func(b *testing.B) {
			ic, err := interceptor.New(interceptor.WithBreaker(bc.s))
			if err != nil {
				b.Fatal(err)
			}
			unary := ic.Unary()
			ctx := context.Background()
			unary(ctx, "/bench.Service/Method", nil, nil, cc, invoker) // joins the fleet
			if bc.s.Fleet != nil {
				br := ic.Breakers().Get(cc.Target(), "/bench.Service/Method")
				testutil.Eventually(b, "the breaker to follow the fleet", br.Shared)
			}
			before := commands(b, srv.Addr)
			b.ReportAllocs()
			for b.Loop() {
				unary(ctx, "/bench.Service/Method", nil, nil, cc, invoker)
			}
			b.ReportMetric(float64(commands(b, srv.Addr)-before-1)/float64(b.N), "redis-cmds/op")
		})
	}
}
