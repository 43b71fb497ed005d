#pragma once
// A page for a view that this version does not have yet: its title and what it will show. It holds
// no data, so nothing on it can be mistaken for a result.
#include <QWidget>

namespace hh::workbench {

class PlaceholderPage : public QWidget {
  Q_OBJECT

 public:
  PlaceholderPage(const QString& title, const QString& description, QWidget* parent = nullptr);
  QString title() const { return title_; }

 private:
  QString title_;
};

}  // namespace hh::workbench
