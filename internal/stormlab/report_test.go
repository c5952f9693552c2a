package stormlab

import (
	"encoding/xml"
	"io"
	"strings"
	"testing"
)

// TestWriteSVGEmptySection: a section with no results adds nothing to the
// chart (it used to panic on results[0]), and a chart with no results at
// all is still a well-formed SVG document.
func TestWriteSVGEmptySection(t *testing.T) {
	rs := []Result{{Strategy: "a", Stats: fakeStats(100, []int64{0, 7, 2}, 5000, 1200)}}
	var one strings.Builder
	if err := WriteSVG(&one, []SVGSection{{Title: "t", Results: rs}}); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name     string
		sections []SVGSection
		want     string // "" for an empty chart
	}{
		{"no sections", nil, ""},
		{"one empty section", []SVGSection{{Title: "empty"}}, ""},
		{"empty sections around one with results",
			[]SVGSection{{Title: "empty"}, {Title: "t", Results: rs}, {Title: "also empty", Results: []Result{}}}, one.String()},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var b strings.Builder
			if err := WriteSVG(&b, tt.sections); err != nil {
				t.Fatalf("WriteSVG: %v", err)
			}
			got := b.String()
			if err := wellFormed(got); err != nil || !strings.HasPrefix(got, "<svg") {
				t.Errorf("WriteSVG = %q (%v), want a well-formed <svg> document", got, err)
			}
			if strings.Contains(got, "empty") {
				t.Errorf("an empty section left its title:\n%s", got)
			}
			switch {
			case tt.want == "" && strings.Contains(got, "<text"):
				t.Errorf("WriteSVG of no results drew something:\n%s", got)
			case tt.want != "" && got != tt.want:
				t.Errorf("WriteSVG =\n%s\nwant the chart of the one section with results:\n%s", got, tt.want)
			}
		})
	}
}

// wellFormed reports whether s is well-formed XML.
func wellFormed(s string) error {
	d := xml.NewDecoder(strings.NewReader(s))
	for {
		if _, err := d.Token(); err == io.EOF {
			return nil
		} else if err != nil {
			return err
		}
	}
}
