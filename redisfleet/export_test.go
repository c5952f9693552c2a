package redisfleet

// Flush waits until the worker has run every report queued before it.
func Flush(f *Fleet) {
	done := make(chan struct{})
	f.queue <- event{kind: evFlush, done: done}
	<-done
}
