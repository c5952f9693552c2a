package redisfleet_test

import (
	"log"
	"time"

	"github.com/redis/go-redis/v9"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/herdguard/herdguard/breaker"
	"github.com/herdguard/herdguard/interceptor"
	"github.com/herdguard/herdguard/redisfleet"
)

// Every replica of a service builds its client this way: the replicas that
// call the same target share one breaker through Redis.
func Example() {
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:6379", ContextTimeoutEnabled: true,
		DialTimeout: 100 * time.Millisecond, ReadTimeout: 100 * time.Millisecond,
		WriteTimeout: 100 * time.Millisecond, MaxRetries: -1})
	defer rdb.Close()
	fleet, err := redisfleet.New(redisfleet.Options{Client: rdb})
	if err != nil {
		log.Fatal(err)
	}
	defer fleet.Close()

	ic, err := interceptor.New(interceptor.WithBreaker(breaker.Settings{Fleet: fleet}))
	if err != nil {
		log.Fatal(err)
	}
	cc, err := grpc.NewClient("dns:///payments.internal:443",
		append(ic.DialOptions(), grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		log.Fatal(err)
	}
	defer cc.Close()
	// calls through cc now share the fleet's breaker for this target
}
