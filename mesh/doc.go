// Package mesh is herdguard's server half: it stops retry amplification
// across the hops of a mesh, where every layer retries and d layers of 3
// attempts send 3^d attempts to the bottom one.
//
// Two rules, after the Google SRE book ("Handling Overload"): retry at one
// layer only, the one right above the failure; and when that layer gives
// up, tell the layers above not to retry. Both apply on evidence that
// more attempts would hurt the server below: a server that fails on its
// own, not overloaded, gets the retries of every layer, as without the
// package.
//
//   - When a call made through herdguard gives up on such evidence (shed
//     by the overload controller, out of attempts while the controller
//     paced its target, refused by an open breaker, stopped by a pushback,
//     or out of budget), the request being served answers with gRPC's
//     standard "don't retry" signal, a grpc-retry-pushback-ms trailer of
//     -1, which herdguard and gRPC's built-in retry in every language
//     honour (gRFC A6), and with a herdguard-gave-up trailer naming the
//     outcome. The handler's status code is kept as it is.
//   - A call made while serving a request with a deadline is sent with that
//     deadline less a reserve (WithDeadlineReserve; by default a twentieth
//     of the time left, at most 3 ms). A call below that runs out of time
//     then ends first, and the request answers its caller in time, with
//     "don't retry" and herdguard-gave-up "deadline", where gRPC's
//     propagation alone has every layer time out at once, each calling the
//     timeout its own.
//   - A herdguard client stopped by such an answer gives up too, whatever
//     the code (a RetryError with OutcomePushbackStop), so that its own
//     server half passes the signal on; and neither its breaker nor its
//     overload controller counts the call: the layer below judged.
//   - A request that is itself a retry or a hedge (grpc-previous-rpc-attempts,
//     herdguard-attempt or x-retry-attempt in its metadata), or that arrived
//     with herdguard-retries-below: 0, passes herdguard-retries-below: 0 on,
//     and, while the connection's overload controller paces the call's
//     target, makes one attempt per call below, so that only one layer
//     retries along any path to a server judged overloaded.
//
// A server installs both halves: the server interceptors, and the client
// half on the connections its handlers call through:
//
//	srv := grpc.NewServer(mesh.ServerOptions()...)
//	ic, err := interceptor.New()
//	if err != nil { ... }
//	cc, err := grpc.NewClient(target, append(mesh.DialOptions(ic),
//		grpc.WithTransportCredentials(creds))...)
//
// Handlers must make their calls with the request's context (or one derived
// from it), as they must for its deadline to propagate. A request whose
// downstream calls succeed is answered as without the package: no trailer
// and no attempt added. The server interceptors allocate nothing on that
// path; the client half sends each call below with the request's deadline
// less the reserve, which costs a context and its timer per call
// (BenchmarkClientHalf).
package mesh
