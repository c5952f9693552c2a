// Package bench measures herdguard side by side with what a user would use
// instead: no interceptor, gRPC's built-in retry, go-grpc-middleware's
// retry, failsafe-go's retry and circuit breaker, and sony/gobreaker alone.
// It is a module of its own so that none of them becomes a dependency of
// herdguard. `make bench` at the repository root runs it.
package bench
