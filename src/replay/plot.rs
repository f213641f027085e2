//! `--plot`: hit fraction and recomputed tokens per policy against device capacity.
//!
//! Drawn with plotters' bitmap backend only. Text comes from the public-domain 8x8 bitmap
//! font of the `font8x8` crate, drawn pixel by pixel, so nothing needs system fonts or
//! fontconfig at build or run time.

use std::path::Path;

use plotters::prelude::*;

use super::ReplayError;
use super::report::Report;

const W: u32 = 1000;
const H: u32 = 820;
const LEFT: i32 = 110;
const RIGHT: i32 = 960;

fn policy_color(name: &str) -> RGBColor {
    match name {
        "device-lru" => RGBColor(214, 39, 40),
        "write-through" => RGBColor(31, 119, 180),
        "session-aware" => RGBColor(44, 160, 44),
        "exclusive-lru" => RGBColor(255, 127, 14),
        _ => RGBColor(90, 90, 90),
    }
}

type Area<'a> = DrawingArea<BitMapBackend<'a>, plotters::coord::Shift>;

fn err(e: impl std::fmt::Display) -> ReplayError {
    ReplayError::Plot(e.to_string())
}

/// Draws `s` with its top-left corner at (x, y), `scale` pixels per font pixel.
fn text(area: &Area, x: i32, y: i32, s: &str, color: &RGBColor, scale: i32) -> Result<(), ReplayError> {
    for (i, c) in s.chars().enumerate() {
        let glyph = font8x8::legacy::BASIC_LEGACY.get(c as usize).copied().unwrap_or([0; 8]);
        let cx = x + i as i32 * 8 * scale;
        for (row, bits) in glyph.iter().enumerate() {
            for col in 0..8 {
                if bits & (1 << col) != 0 {
                    let (px, py) = (cx + col * scale, y + row as i32 * scale);
                    for dy in 0..scale {
                        for dx in 0..scale {
                            area.draw_pixel((px + dx, py + dy), color).map_err(err)?;
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

fn text_width(s: &str, scale: i32) -> i32 {
    s.chars().count() as i32 * 8 * scale
}

/// One panel: a line per series over the sweep points.
struct Panel<'s> {
    top: i32,
    bottom: i32,
    title: &'s str,
    y_max: f64,
    y_label: fn(f64) -> String,
}

fn panel(area: &Area, p: &Panel, xs: &[String], series: &[(String, Vec<f64>)]) -> Result<(), ReplayError> {
    let n = xs.len().max(2) as i32;
    let x_at = |i: usize| LEFT + 30 + (RIGHT - LEFT - 60) * i as i32 / (n - 1);
    let y_at = |v: f64| p.bottom - ((v / p.y_max.max(1e-12)) * f64::from(p.bottom - p.top)) as i32;
    let grey = RGBColor(220, 220, 220);
    for k in 0..=4 {
        let v = p.y_max * f64::from(k) / 4.0;
        let y = y_at(v);
        area.draw(&PathElement::new(vec![(LEFT, y), (RIGHT, y)], grey.stroke_width(1)))
            .map_err(err)?;
        let label = (p.y_label)(v);
        text(area, LEFT - 8 - text_width(&label, 1), y - 4, &label, &BLACK, 1)?;
    }
    area.draw(&Rectangle::new(
        [(LEFT, p.top), (RIGHT, p.bottom)],
        BLACK.stroke_width(1),
    ))
    .map_err(err)?;
    text(area, LEFT, p.top - 22, p.title, &BLACK, 2)?;
    for (i, x) in xs.iter().enumerate() {
        text(area, x_at(i) - text_width(x, 1) / 2, p.bottom + 8, x, &BLACK, 1)?;
    }
    for (name, ys) in series {
        let color = policy_color(name);
        let pts: Vec<(i32, i32)> = ys.iter().enumerate().map(|(i, &v)| (x_at(i), y_at(v))).collect();
        area.draw(&PathElement::new(pts.clone(), color.stroke_width(3)))
            .map_err(err)?;
        for pt in pts {
            area.draw(&Circle::new(pt, 4, color.filled())).map_err(err)?;
        }
    }
    Ok(())
}

/// Draws the sweep: one report per device capacity, in increasing order.
pub fn draw(path: &Path, title: &str, sweep: &[Report]) -> Result<(), ReplayError> {
    if sweep.is_empty() {
        return Err(ReplayError::Plot("no sweep points".into()));
    }
    let root = BitMapBackend::new(path, (W, H)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    text(&root, LEFT, 12, title, &BLACK, 2)?;
    let xs: Vec<String> = sweep.iter().map(|r| r.capacity.device_pages.to_string()).collect();
    let names: Vec<&str> = sweep[0].policies.keys().copied().collect();
    let mut hit: Vec<(String, Vec<f64>)> = names
        .iter()
        .map(|n| {
            let ys = sweep.iter().map(|r| r.policies[n].hit_fraction_of_infinite).collect();
            (n.to_string(), ys)
        })
        .collect();
    hit.push((
        "belady".into(),
        sweep
            .iter()
            .map(|r| r.bounds.belady_hit_tokens as f64 / r.bounds.infinite_hit_tokens.max(1) as f64)
            .collect(),
    ));
    let recomputed: Vec<(String, Vec<f64>)> = names
        .iter()
        .map(|n| {
            let ys = sweep
                .iter()
                .map(|r| r.policies[n].recomputed_tokens as f64 / 1e6)
                .collect();
            (n.to_string(), ys)
        })
        .collect();
    let y_max = recomputed
        .iter()
        .flat_map(|(_, v)| v.iter().copied())
        .fold(0.0, f64::max)
        * 1.1;
    panel(
        &root,
        &Panel {
            top: 90,
            bottom: 390,
            title: "prefix-hit tokens / infinite-cache hit tokens",
            y_max: 1.0,
            y_label: |v| format!("{v:.2}"),
        },
        &xs,
        &hit,
    )?;
    panel(
        &root,
        &Panel {
            top: 460,
            bottom: 760,
            title: "recomputed prefill tokens (millions)",
            y_max: y_max.max(1e-6),
            y_label: |v| format!("{v:.1}"),
        },
        &xs,
        &recomputed,
    )?;
    let label = "device capacity (pages); host and pool scale with it";
    text(&root, (LEFT + RIGHT - text_width(label, 1)) / 2, 790, label, &BLACK, 1)?;
    let mut x = LEFT;
    for (name, _) in &hit {
        let c = policy_color(name);
        root.draw(&Rectangle::new([(x, 44), (x + 24, 56)], c.filled()))
            .map_err(err)?;
        text(&root, x + 30, 42, name, &BLACK, 2)?;
        x += 30 + text_width(name, 2) + 16;
    }
    root.present().map_err(err)?;
    Ok(())
}
