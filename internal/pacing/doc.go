// Package pacing is herdguard's overload controller: it paces the attempts
// a client sends to one server once the
// server shows it is overloaded, and leaves them alone while it is not. It
// is configured by package overload's Settings.
//
// # Use
//
// A [Controller] knows counts and time, nothing of gRPC: the caller asks
// [Controller.Acquire] before every attempt (first attempts included), or
// reports it with [Controller.Sent] while [Controller.Pacing] is false, and
// reports each attempt's [Outcome] with [Controller.Done] (or
// [Controller.TimedOut], for one whose caller's deadline passed in flight).
// [overload.Settings] holds the defaults; its zero value means every one.
//
// The controller holds attempts back only on evidence that holding back
// helps: the server is overloaded (what it serves stops growing with what
// it is sent), or down (nothing succeeds); a server that fails a share of
// its attempts on its own is left to the retries. Its rules, and why each
// is as it is, are written out in design.go; docs/overload.md tells the
// user's side, with the storm lab's measurements.
package pacing
