#include "style_helpers.h"

#include <QWidget>

namespace hh::workbench {
namespace {
constexpr double kMutedMix = 0.42;  // share of the background in the muted text colour
}

QColor mutedTextColor(const QPalette& palette) {
  const QColor text = palette.color(QPalette::Active, QPalette::WindowText);
  const QColor back = palette.color(QPalette::Active, QPalette::Window);
  auto mix = [](int a, int b) { return static_cast<int>(a * (1.0 - kMutedMix) + b * kMutedMix + 0.5); };
  return QColor(mix(text.red(), back.red()), mix(text.green(), back.green()), mix(text.blue(), back.blue()));
}

void setMuted(QWidget* w) {
  QPalette p = w->palette();
  const QColor muted = mutedTextColor(p);
  p.setColor(QPalette::WindowText, muted);
  p.setColor(QPalette::Text, muted);
  w->setPalette(p);
}

QFont headingFont(const QFont& base, double scale) {
  QFont f = base;
  f.setPointSizeF(f.pointSizeF() * scale);
  f.setBold(true);
  return f;
}

}  // namespace hh::workbench
