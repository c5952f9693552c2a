// Package overload configures herdguard's overload controller: the pacing
// that holds a target's attempts back once the server shows it is
// overloaded, and leaves them alone while it is not. The interceptor runs
// one controller per target, on by default ([Settings]' zero value), or
// as interceptor.WithOverloadControl configures it.
//
// How the controller decides, and what it does while it paces (the rate,
// the line, probes, a server that is down, independent failures), is in
// docs/overload.md, as 12 numbered rules; the defaults are in the
// interceptor's package doc.
package overload
